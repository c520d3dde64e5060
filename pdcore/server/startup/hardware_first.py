"""A command line for hardware this machine lacks (`--device npu` without an NPU) that also uses
flags pdserve does not build, or a `--quantization` format it does not run (`modelslim`): the
missing hardware is what stops it first, so the exit-2 message names the device, then lists the
unbuilt flags and refused values the line would hit next (argparse alone would only report the
unknown flags)."""

from __future__ import annotations

import argparse
import contextlib
import io


def hardware_refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The message to exit 2 with, or None (the line's device is here, or every flag is known:
    then the ordinary checks decide)."""
    try:  # quietly: for a known flag with a bad value the ordinary parse says it, once
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            ns, unknown = parser.parse_known_args(argv)
    except SystemExit:
        return None
    unbuilt = [a for a in unknown if a.startswith("-")]
    device = getattr(ns, "device", "cpu")
    if device == "cpu":
        return None
    quant = _quantization_refusal(ns)
    if not unbuilt and quant is None:
        return None
    from pdcore.plugins.host import platforms

    registry = platforms()
    if device not in registry:
        why = (f"no platform plugin named {device!r} is installed (npu: pip install "
               "./plugins/pd-ascend; see `pdserve plugins`)")
    else:
        ok, reason = registry.get(device).available()
        if ok:
            return None
        why = f"it is not available here: {reason}"
    from pdcore.config import ServerArgs

    found: list[str] = [quant] if quant else []
    # known flags with values pdserve does not support (--tokenizer-worker-num 4), and the
    # speculative algorithm apart, which validate() reaches only after the rest
    for check in (ServerArgs.validate, ServerArgs.validate_speculative):
        try:
            check(ServerArgs(**vars(ns)))
        except Exception as e:  # noqa: BLE001 - only reported, after the device
            if str(e) not in found:
                found.append(str(e))
    if not unbuilt:
        return (f"--device {device} needs that hardware and {why}. The line also has settings "
                f"pdserve refuses: {'; and '.join(found)}")
    also = "".join(f"; and {e}" for e in found)
    return (f"--device {device} needs that hardware and {why}. The line also uses flags "
            f"pdserve does not have (features not built here): {', '.join(unbuilt)} (drop them "
            f"to run without){also}")


def _quantization_refusal(ns: argparse.Namespace) -> str | None:
    """Why the line's --quantization (or its checkpoint's format) would be refused, or None."""
    from pdcore.errors import ConfigError
    from pdcore.runtime import checked_quantization

    try:
        checked_quantization(getattr(ns, "quantization", None), getattr(ns, "model_path", None))
    except ConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - a model path that is not there: the ordinary checks say so
        return None
    return None
