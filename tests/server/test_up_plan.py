"""`pdserve up` planning (no servers started): the same-host backend default and the argv."""

from __future__ import annotations

import socket

import pytest

from pdcore.config import HOST_SERVERS_ENV
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


def test_up_splits_the_kv_budget_over_its_servers() -> None:
    """Each of up's servers is told how many share the host's KV budget (2P2D: 4); a user who
    sized the pools (either flag, either spelling) gets exactly that on every server."""
    servers, router = plan(UpConfig(prefill=2, decode=2), "shm")
    assert [s.env.get(HOST_SERVERS_ENV) for s in servers] == ["4"] * 4
    assert HOST_SERVERS_ENV not in router.env
    for sizing in (["--max-total-tokens", "8192"], ["--mem-fraction-static=0.2"]):
        servers, _ = plan(UpConfig(prefill=2, decode=1, serve_args=sizing), "shm")
        assert all(HOST_SERVERS_ENV not in s.env for s in servers)
        assert all(sizing[0] in s.argv for s in servers)


def test_a_server_told_it_shares_the_host_sizes_its_pool_to_its_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pdcore.config import ServerArgs
    from pdcore.engine.build import kv_pool_tokens
    from pdcore.interfaces.platform import MemoryInfo

    class Host:
        def memory_info(self, device: torch.device) -> MemoryInfo:
            return MemoryInfo(free_bytes=16 << 30, total_bytes=16 << 30)

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: every server holds its own copy
    budget = int((16 << 30) * 0.1) - 1024 * 1025 * 4
    args = ServerArgs(max_running_requests=1000)
    cpu = torch.device("cpu")
    for n in (1, 4):
        monkeypatch.setenv(HOST_SERVERS_ENV, str(n))
        assert kv_pool_tokens(args, Host(), cpu, model, 4096, 8192) == budget // n // 4096
    # the user's sizing is per server, whatever up said
    given = ServerArgs(max_running_requests=1000, max_total_tokens=12345)
    assert kv_pool_tokens(given, Host(), cpu, model, 4096, 8192) == 12345
    monkeypatch.setenv(HOST_SERVERS_ENV, "0")
    with pytest.raises(ConfigError, match=HOST_SERVERS_ENV):
        kv_pool_tokens(args, Host(), cpu, model, 4096, 8192)


def test_default_kv_pool_when_the_weights_fill_the_default_share(monkeypatch) -> None:
    """A model over 10% of host memory (a 1B float32 model on 24 GiB) still starts with pdserve
    defaults: the KV pool gets 1/40 of the host; an explicit --mem-fraction-static that leaves
    nothing is still refused, saying what to change."""
    import torch

    from pdcore.config import ServerArgs
    from pdcore.engine.build import kv_pool_tokens
    from pdcore.interfaces.platform import MemoryInfo

    total = 1 << 30  # a 1 GiB "host", a 0.5 GiB model

    class Host:
        def memory_info(self, device: torch.device) -> MemoryInfo:
            return MemoryInfo(free_bytes=total, total_bytes=total)

    model = torch.nn.Linear(8192, 16384, bias=False)
    monkeypatch.delenv(HOST_SERVERS_ENV, raising=False)
    args = ServerArgs(max_running_requests=1000)
    cpu = torch.device("cpu")
    assert kv_pool_tokens(args, Host(), cpu, model, 4096, 8192) == total // 40 // 4096
    monkeypatch.setenv(HOST_SERVERS_ENV, "2")  # `pdserve up`: the floor is split as well
    assert kv_pool_tokens(args, Host(), cpu, model, 4096, 8192) == total // 40 // 2 // 4096
    with pytest.raises(ConfigError, match="--mem-fraction-static 0.3 .* raise it"):
        kv_pool_tokens(ServerArgs(mem_fraction_static=0.3), Host(), cpu, model, 4096, 8192)


def test_routers_n_are_peers_on_consecutive_ports() -> None:
    """--routers 3: routers on --port, +1, +2 over the same servers and secrets, each told the
    other two (--peer-routers); --routers 1 is the one router, with no peers."""
    from pdcore.router.cli import parse_router_args
    from pdcore.up import plan_routers

    cfg = UpConfig(prefill=1, decode=2, port=9100, routers=3)
    servers, first = plan(cfg, "tcp")
    routers = plan_routers(cfg, first)
    assert [r.name for r in routers] == ["router", "router-1", "router-2"]
    urls = [f"http://127.0.0.1:{9100 + k}" for k in range(3)]
    assert [r.url for r in routers] == urls
    for k, r in enumerate(routers):
        parsed = parse_router_args(r.argv[3:])  # after python -m pdcore.router
        assert parsed.port == 9100 + k and parsed.peer_routers == [u for u in urls if u != urls[k]]
        assert [u for u, _ in parsed.prefill] + parsed.decode == [s.url for s in servers]
        assert r.env == first.env  # the same cluster secret and admin key
    assert plan_routers(UpConfig(), plan(UpConfig(), "tcp")[1])[0].argv.count(
        "--peer-routers") == 0
    with pytest.raises(ConfigError, match="--routers"):
        plan(UpConfig(routers=0), "tcp")
    # every router's port is checked before anything starts
    from pdcore.up import check_ports
    from pdserve_testing import free_port

    base, boot, port = free_port(offsets=(0, 100)), free_port(), free_port(offsets=(0, 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 1))
        s.listen(1)
        with pytest.raises(ConfigError, match=f"router-1 .*{port + 1}.*pick another --port"):
            check_ports(UpConfig(port=port, server_port_base=base, bootstrap_port_base=boot,
                                 routers=2))
