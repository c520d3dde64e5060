"""`pdserve up` planning (no servers started): the same-host backend default and the argv."""

from __future__ import annotations

import pytest

from pdcore.errors import ConfigError
from pdcore.up import UpConfig, choose_backend, plan


def test_shm_is_the_local_default_and_says_why() -> None:
    backend, why = choose_backend(UpConfig())
    assert backend == "shm" and "this host" in why and "PDCORE_SHM_MODE" in why
    assert choose_backend(UpConfig(backend="tcp")) == ("tcp", "chosen with --backend")


def test_plan_gives_every_server_the_backend_and_the_router_every_server() -> None:
    servers, router = plan(UpConfig(prefill=1, decode=2, serve_args=["--page-size", "16"]), "shm")
    assert [s.name for s in servers] == ["prefill-0", "decode-0", "decode-1"]
    for s in servers:
        i = s.argv.index("--disaggregation-transfer-backend")
        assert s.argv[i + 1] == "shm" and "--page-size" in s.argv
    assert router.argv.count("--prefill") == 1 and router.argv.count("--decode") == 2
    with pytest.raises(ConfigError, match=">= 1"):
        plan(UpConfig(decode=0), "shm")


@pytest.mark.parametrize("args", [["--api-key", "k1"], ["--api-key=k1"]])
def test_the_servers_api_key_reaches_the_router(args: list[str]) -> None:
    _, router = plan(UpConfig(serve_args=args), "tcp")
    i = router.argv.index("--api-key")
    assert router.argv[i + 1] == "k1"
    _, router = plan(UpConfig(), "tcp")
    assert "--api-key" not in router.argv
