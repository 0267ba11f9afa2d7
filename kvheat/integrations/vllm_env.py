"""Is this environment one vLLM imports in? One check, run before any vLLM import.

The trap: `pip install -e ".[vllm]"` into a CPU environment brings PyPI's torchvision,
torchaudio and torchcodec, built for PyPI's (CUDA) torch. Beside the CPU torch that
vLLM's CPU build pins they do not load (`operator torchvision::nms does not exist`), and
vLLM, which imports them through transformers, fails with that line and no hint. vLLM's
CPU build needs none of them; `make vllm` removes them. Here the first import that fails
says in one line what to run.
"""

from __future__ import annotations

import importlib
import sys

# The packages that come with the vllm extra and must load with the installed torch.
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec"


class BrokenTorchExtras(ImportError):
    """A torch extension package is installed that does not load with this torch."""


def check_torch_extras(packages: tuple[str, ...] = TORCH_EXTRAS) -> None:
    """Import each installed package of `packages`.

    The first that is installed but does not load raises `BrokenTorchExtras` naming it and
    the command that fixes it."""
    for name in packages:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # not installed: nothing to break
            raise BrokenTorchExtras(_message(name, e)) from None
        except Exception as e:  # RuntimeError from a torch op registry, OSError, ...
            raise BrokenTorchExtras(_message(name, e)) from None


def import_error(e: BaseException) -> ImportError:
    """What a failed vLLM import raises.

    `BrokenTorchExtras` when a torch extension is the cause, else the error itself as an
    ImportError."""
    try:
        check_torch_extras()
    except BrokenTorchExtras as broken:
        return broken
    if isinstance(e, ImportError):
        return e
    return ImportError(f"vLLM does not import: {type(e).__name__}: {e}")


def _message(name: str, e: BaseException) -> str:
    import torch

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"{name} does not load with torch {torch.__version__} ({first}); vLLM's CPU build "
            f"needs none of them: run `{FIX}` (or `make vllm`)")


def check_vllm() -> str:
    """The one-line verdict on this environment: vLLM imports, at this version.

    Else raises ImportError saying what is wrong: not installed, or what breaks its import."""
    check_torch_extras()  # first: it names the fix where vLLM's own error would not
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name == "vllm":
            raise ImportError("vLLM is not installed in this environment "
                              f"({sys.executable}): run `make vllm`") from None
        raise import_error(e) from None
    except Exception as e:  # an import that fails deeper: RuntimeError, OSError, ...
        raise import_error(e) from None
    return (f"ok: vLLM {getattr(vllm, '__version__', '(version unknown)')} imports; "
            "torchvision, torchaudio and torchcodec are absent or load with this torch")


if __name__ == "__main__":  # python -m kvheat.integrations.vllm_env: check an environment
    try:
        print(check_vllm())
    except ImportError as e:
        sys.exit(f"error: {e}")
