"""Math-v0: single-turn reasoning with a verifiable final answer (the paper's single-turn case).

Problems: arithmetic expressions with precedence, linear equations, percentages and rate problems, all
with integer answers. The reply may reason first; the answer is the last `\\boxed{...}`.
Reward: 1 for the right answer, else 0.
"""

from __future__ import annotations

import random

from reflow.env import AssistantTurn, Env, Message, Observation, StepResult, Task
from reflow.env.answers import extract_boxed, format_number, numbers_equal, parse_number

SYSTEM_PROMPT = "Solve the problem. Think step by step, then give the final answer as \\boxed{N}."


def _expression(rng: random.Random) -> tuple[str, int, str]:
    a, b, c, d = (rng.randint(2, 20) for _ in range(4))
    form = rng.choice(["{a} * ({b} - {c}) + {d}", "({a} + {b}) * {c} - {d}", "{a} + {b} * {c} - {d}"])
    expr = form.format(a=a, b=b, c=c, d=d)
    value = eval(expr)  # our own template with integer literals only
    return f"Compute {expr}.", value, f"{expr} = {value}"


def _equation(rng: random.Random) -> tuple[str, int, str]:
    x, a, b = rng.randint(-10, 20), rng.randint(2, 9), rng.randint(1, 40)
    return f"Solve for x: {a}x + {b} = {a * x + b}.", x, f"{a}x = {a * x + b} - {b} = {a * x}, x = {x}"


def _percent(rng: random.Random) -> tuple[str, int, str]:
    p, base = rng.choice([10, 20, 25, 50, 75]), rng.randint(1, 40) * 4
    value = p * base // 100 if p * base % 100 == 0 else None
    if value is None:
        base, value = 100, p
    return f"What is {p}% of {base}?", value, f"{p}/100 * {base} = {value}"


def _rate(rng: random.Random) -> tuple[str, int, str]:
    speed, hours = rng.randint(3, 90), rng.randint(2, 9)
    text = f"A cyclist rides at {speed} km per hour for {hours} hours. How many km does she ride?"
    return text, speed * hours, f"{speed} * {hours} = {speed * hours}"


FAMILIES = {"expression": _expression, "equation": _equation, "percent": _percent, "rate": _rate}


class MathEnv(Env):
    required_task_keys = ("id", "question", "answer")

    def __init__(self, tasks: list[Task] | str | None = None) -> None:
        super().__init__(tasks)

    def generate_task(self, rng: random.Random) -> Task:
        family = rng.choice(sorted(FAMILIES))
        question, answer, working = FAMILIES[family](rng)
        task_id = f"math-{rng.getrandbits(48):012x}"
        return {"id": task_id, "family": family, "question": question, "answer": answer, "working": working}

    async def _reset(self, task: Task) -> Observation:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
        ]
        return Observation(messages)

    async def step(self, turn: AssistantTurn) -> StepResult:
        boxed = extract_boxed(turn.content)
        correct = numbers_equal(parse_number(boxed), float(self.task["answer"]))
        return StepResult.final(
            correct,
            termination="answered" if boxed is not None else "no_answer",
            components={"correct": float(correct), "format": float(boxed is not None)},
        )

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        answer = task["answer"]
        working = task.get("working", "")
        if rng.random() < error_rate:
            answer += rng.choice([-3, -1, 1, 2, 5])
            working = working.rsplit("=", 1)[0] + f"= {answer}" if "=" in working else working
        return f"<think>\n{working}\n</think>\nThe answer is \\boxed{{{format_number(answer)}}}."
