"""torch-npu access: the only module that imports `torch_npu`.

`availability()` answers whether an NPU can be used here, and if not, exactly why: torch-npu
is not installed, it fails to load (CANN libraries such as libhccl.so missing: the text of the
import error is quoted), or it loads but no device answers. The answer is computed once per
process; importing torch_npu is only attempted where the package is installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

INSTALL_HINT = "pip install torch-npu (pd-ascend's [npu] extra); needs Ascend CANN"
CANN_HINT = ("torch-npu needs the Ascend CANN runtime: source "
             "/usr/local/Ascend/ascend-toolkit/set_env.sh before starting pdserve")
AUTOLOAD_HINT = ("on a machine without CANN, uninstall torch-npu (or set "
                 "TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that plain `import torch` works)")


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(True, "") when torch_npu loads and at least one NPU answers, else (False, why)."""
    try:
        found = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError) as e:
        found, detail = False, f" ({_error_text(e)})"
    else:
        detail = ""
    if not found:
        return False, f"torch_npu is not installed{detail} ({INSTALL_HINT})"
    try:
        npu = load()
    except Exception as e:  # noqa: BLE001 - ImportError (missing .so), RuntimeError (autoload)
        return False, (f"torch_npu is installed but fails to load: {_error_text(e)}; "
                       f"{CANN_HINT}; {AUTOLOAD_HINT}")
    try:
        count = int(npu.device_count()) if npu.is_available() else 0
    except Exception as e:  # noqa: BLE001 - a driver error is a reason, not a crash
        return False, f"torch_npu loaded but querying NPUs failed: {_error_text(e)}"
    if count < 1:
        return False, ("torch_npu loaded but no NPU answers (torch.npu.device_count() == 0); "
                       "check the Ascend driver (npu-smi info) and ASCEND_RT_VISIBLE_DEVICES")
    return True, ""


def load() -> Any:
    """Import torch_npu (registers the `npu` device with torch) and return `torch.npu`."""
    importlib.import_module("torch_npu")
    import torch

    return torch.npu  # type: ignore[attr-defined]


def device_count() -> int:
    return int(load().device_count())


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of NPU `index`."""
    free, total = load().mem_get_info(index)
    return int(free), int(total)


def synchronize(index: int) -> None:
    load().synchronize(index)
