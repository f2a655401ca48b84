"""Import shim for torchvision, used only by the SGLang schema tests.

PyPI's torchvision does not load beside the CPU torch build, and sglang imports it at module level for
vision models these tests never touch. Every attribute is an empty placeholder class.
"""

__version__ = "0.0.0+reflow.shim"


def __getattr__(name: str) -> type:
    return type(name, (), {})
