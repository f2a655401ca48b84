"""LoRA RL (`model.lora`): the trainer trains peft adapters on a frozen base, on one rank or two FSDP2
ranks; checkpoints hold the adapters and load merged; weight sync hands engines the adapters alone."""

import json

import pytest
import torch
from engine_helpers import build_tiny_engine_model, greedy, prompt, small_qwen3
from test_trainer import _capture_grads, _config, _model, _rows, _two_ranks

from reflow.engine.torch_engine import TorchEngine
from reflow.models import load_model
from reflow.models.adapters import ADAPTER_CONFIG, is_adapter_folder
from reflow.train.lora import adapter_state_dict, apply_lora, is_adapter, load_lora_model
from reflow.train.settings import LoraSettings
from reflow.train.trainer import PolicyTrainer, TrainerConfig
from reflow.train.trainer_state import load_checkpoint, save_checkpoint

LORA = LoraSettings(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny-preset model folder (the LoRA base) and its pad id."""
    path, _, tokenizer = build_tiny_engine_model(tmp_path_factory.mktemp("lora-base"))
    return path, tokenizer.pad_token_id


def _trainer(path, pad_id, lora=LORA, seed=0) -> PolicyTrainer:
    model, _ = load_model(path)
    return PolicyTrainer(model, pad_id, TrainerConfig(lr=1e-2, bf16=False, lora=lora, seed=seed))


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}


def test_a_lora_step_trains_only_the_adapters_and_the_optimizer_holds_only_them(base):
    trainer = _trainer(*base)
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert names and all(is_adapter(n) for n in names)
    assert {n.split(".")[-4] for n in names} == set(LORA.target_modules)
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in trainer.model.named_parameters() if is_adapter(n)}
    frozen, adapters = _base_weights(trainer.model), adapter_state_dict(trainer.model)
    for _ in range(2):  # B starts at zero, so A gets a gradient from the second step on
        metrics = trainer.train_step(_rows(8))
        assert metrics["updates"] == 1 and metrics["grad_norm"] > 0
    for name, value in _base_weights(trainer.model).items():
        assert torch.equal(value, frozen[name]), name  # bitwise
    after = adapter_state_dict(trainer.model)
    assert all(not torch.equal(after[n], adapters[n]) for n in after)  # every A and every B moved
    assert set(trainer.optimizer_state()["state"]) == names
    assert set(trainer.full_state_dict()) == set(after)  # what weight sync sends: the adapters alone


def test_lora_refuses_targets_the_model_lacks_and_names_peft_when_it_is_missing(base, monkeypatch):
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['qkv'\]"):
        _trainer(*base, lora=LoraSettings(target_modules=["qkv"]))
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # as if not installed
    with pytest.raises(ImportError, match=r"model.lora needs peft: pip install 'reflow-rl\[train\]'"):
        apply_lora(small_qwen3(), LORA)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "lora-bf16"])
def test_fsdp2_two_ranks_match_one_rank_under_lora(tmp_path, kind):
    """Two gloo ranks sharding a model whose base is frozen take the steps one rank takes: the same
    adapter gradients, the base untouched on both; also on a bf16 base, whose float32 adapters make
    each FSDP unit hold two dtypes."""
    sharded = _two_ranks(tmp_path, 8, 16384, "token_mean", kind)
    model = _model().to(torch.bfloat16) if kind == "lora-bf16" else _model()
    single = PolicyTrainer(model, 0, _config(rows=kind))
    grads = _capture_grads(single)
    frozen = _base_weights(single.model)
    for _ in range(2):
        metrics = single.train_step(_rows(8))
    assert set(sharded["state"]) == set(adapter_state_dict(single.model))  # adapters only, unsharded
    assert all(torch.equal(v, frozen[n]) for n, v in _base_weights(single.model).items())
    # Adam's first steps are ~lr * sign(grad): gradients that are float noise may flip, no more than that
    for key, value in adapter_state_dict(single.model).items():
        assert torch.allclose(sharded["state"][key], value, atol=2.5e-2), key
    assert set(sharded["grads"]) == set(grads)
    assert all(g.dtype == torch.float32 for g in sharded["grads"].values())  # the adapters' own dtype
    if kind == "lora-bf16":  # bf16 forwards over other row sets round otherwise: a few % per tensor
        assert sharded["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-3)
        flat = torch.cat([grads[n].flatten() for n in sorted(grads)])
        got = torch.cat([sharded["grads"][n].flatten() for n in sorted(grads)])
        assert float((got - flat).norm() / flat.norm()) < 0.05  # a wrong gather or reduction: ~100%
    else:
        assert sharded["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
        # clipping measures the adapters' gradient alone, on every rank the norm one rank measures
        assert sharded["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
        assert metrics["grad_norm"] > 0
        for name, grad in grads.items():
            assert torch.allclose(sharded["grads"][name], grad, atol=1e-6), name


def test_a_checkpoint_holds_the_adapters_resumes_them_and_loads_merged(base, tmp_path):
    path, pad_id = base
    trainer = _trainer(path, pad_id)
    for _ in range(2):
        trainer.train_step(_rows(8))
    ckpt = save_checkpoint(tmp_path, trainer, extra={"next_seed": 7})
    assert is_adapter_folder(ckpt) and not list(ckpt.glob("model*.safetensors"))  # no base weights
    config = json.loads((ckpt / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(path.resolve()) and config["r"] == LORA.r
    saved = adapter_state_dict(trainer.model)
    expected = trainer.train_step(_rows(8, seed=5))  # what the run does next

    fresh = _trainer(path, pad_id, seed=3)  # other initial adapters
    assert load_checkpoint(ckpt, fresh) == {"next_seed": 7}
    restored = adapter_state_dict(fresh.model)
    assert all(torch.equal(restored[n], saved[n]) for n in saved)
    assert (fresh.step, fresh.version) == (2, 2)
    assert fresh.train_step(_rows(8, seed=5))["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    for name, value in adapter_state_dict(fresh.model).items():
        assert torch.allclose(value, adapter_state_dict(trainer.model)[name], atol=1e-6), name

    # load_model merges: a plain model (no adapter layer) computing what base + adapters compute
    merged, _ = load_model(ckpt)
    assert not any(is_adapter(n) for n, _ in merged.named_parameters())
    served, _ = load_lora_model(ckpt, LORA)  # what an engine of a resumed run starts from
    assert all(torch.equal(v, saved[n]) for n, v in adapter_state_dict(served).items())
    ids = torch.tensor([prompt(12, seed=1)])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, served(ids).logits, atol=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        load_lora_model(ckpt, LoraSettings(r=8, target_modules=LORA.target_modules))


async def test_weight_sync_of_the_adapters_makes_the_engine_generate_as_the_merged_model(base, tmp_path):
    path, pad_id = base
    trainer = _trainer(path, pad_id)
    for _ in range(3):
        trainer.train_step(_rows(8))
    ckpt = save_checkpoint(tmp_path, trainer)
    model, tokenizer = load_lora_model(path, LORA)  # a rollout worker's engine: fresh adapters
    engine = TorchEngine(model, tokenizer, max_batch_size=2)
    merged_model, _ = load_model(ckpt)
    merged = TorchEngine(merged_model, tokenizer, max_batch_size=2)
    try:
        ids = prompt(10, seed=2)
        before = await engine.generate(ids, greedy(16))
        adapters = trainer.full_state_dict()
        assert adapters and all(is_adapter(k) for k in adapters)
        assert await engine.update_weights(state_dict=adapters, version=3) == 3
        got, want = await engine.generate(ids, greedy(16)), await merged.generate(ids, greedy(16))
        assert got.output_ids == want.output_ids != before.output_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4)
        await engine.update_weights(state_dict={k: torch.zeros_like(v) for k, v in adapters.items()})
        assert (await engine.generate(ids, greedy(16))).output_ids == before.output_ids  # the base again
        await engine.update_weights(path=str(ckpt))  # the checkpoint's adapters, from disk
        assert (await engine.generate(ids, greedy(16))).output_ids == want.output_ids
    finally:
        await engine.close()
        await merged.close()


def test_apply_lora_starts_every_copy_from_the_same_float32_adapters_and_the_same_outputs():
    a, b = small_qwen3(seed=0), small_qwen3(seed=0)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        plain = a(ids).logits
    apply_lora(a, LORA, seed=4)
    torch.manual_seed(123)  # the global RNG does not decide the adapters: the seed does
    apply_lora(b, LORA, seed=4)
    assert all(torch.equal(v, adapter_state_dict(b)[k]) for k, v in adapter_state_dict(a).items())
    with torch.no_grad():
        assert torch.equal(a(ids).logits, plain)  # B = 0: the same model until trained
    half = apply_lora(small_qwen3(seed=0).to(torch.bfloat16), LORA)
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert {d for n, d in dtypes.items() if is_adapter(n)} == {torch.float32}  # trained in float32
    assert {d for n, d in dtypes.items() if not is_adapter(n)} == {torch.bfloat16}
    with torch.no_grad():
        assert half(ids).logits.dtype == torch.bfloat16


def test_apply_lora_keeps_an_eval_model_in_eval_mode_so_adapter_dropout_is_off(base):
    """`load_model` gives a model in eval mode (engines, evaluation); the adapters injected into it stay
    in that mode, so `model.lora.dropout` noise is the trainer's alone, as documented."""
    model = small_qwen3(seed=0).eval()
    settings = LoraSettings(r=4, alpha=8.0, dropout=0.5, target_modules=["q_proj", "v_proj"])
    apply_lora(model, settings)
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.1)  # adapters that act: dropout on their input would show
        ids = torch.tensor([[1, 5, 9, 3]])
        assert torch.equal(model(ids).logits, model(ids).logits)
    served, _ = load_lora_model(base[0], settings)
    assert not any(m.training for m in served.modules())


def test_a_run_folder_moved_or_copied_elsewhere_reads_its_own_base_in_checkpoints_and_resume(tmp_path):
    import shutil

    from reflow.models.adapters import base_model_path
    from reflow.recipes.initial_model import resumed_model
    from reflow.train.lora import save_adapters

    def run_with_base(run, weights: str):
        (run / "model-base").mkdir(parents=True)
        (run / "model-base" / "config.json").write_text(weights)
        adapters = {"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 8)}
        return save_adapters(run / "checkpoints" / "step-000001", adapters, LORA, base=run / "model-base")

    run = tmp_path / "here" / "run"
    run_with_base(run, "{}")
    moved = tmp_path / "there" / "run"
    shutil.move(run, moved)  # copied to another machine, or renamed
    ckpt = moved / "checkpoints" / "step-000001"
    assert base_model_path(ckpt) == (moved / "model-base").resolve()
    # peft's own field still names the base where it was written (peft and SGLang read it as they will)
    assert json.loads((ckpt / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(
        (run / "model-base").resolve()
    )
    # resumed there: the checkpoint linked one level up still names the moved run's base, and the
    # checkpoint's own link (a hard link's other name) is left as it was
    resumed = resumed_model(ckpt, moved)
    assert base_model_path(resumed) == (moved / "model-base").resolve()
    assert base_model_path(ckpt) == (moved / "model-base").resolve()
    # a copy whose original is still there, its base since rebuilt: the copy reads its own base
    run_with_base(run, '{"rebuilt": true}')
    assert base_model_path(ckpt) == (moved / "model-base").resolve()
    shutil.rmtree(moved / "model-base")  # its own base gone: the absolute path is what is left
    assert base_model_path(ckpt) == (run / "model-base").resolve()
    shutil.rmtree(run / "model-base")  # gone everywhere: the error names it
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        base_model_path(ckpt)
