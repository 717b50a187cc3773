"""`radixmesh up --prefill N --decode M`, as command lines (no child is started): the plan's
children, each one's flags parsed by its own service's config, the roles on the workers and
schedulers, a prefill scheduler advertising its own loopback address, the router's two pools."""
from __future__ import annotations

import argparse
import sys

import pytest

from services.common.config import config_from_args, flags_from_dataclass
from services.launcher import pd, up
from services.launcher.children import Child
from services.launcher.up import CONFIG_CLASSES, Mesh, UpConfig, load_ref, plan, route_flags, worker_threads

REPLICA = ("worker", "scheduler", "detokenizer", "tokenizer")


def _parse(service: str, argv: list[str]):
    cls = load_ref(CONFIG_CLASSES[service])
    parser = flags_from_dataclass(cls, argparse.ArgumentParser(prog=service, exit_on_error=False))
    return config_from_args(cls, parser.parse_args(argv))


def _field(config, name: str):
    """A config's value, looking inside its nested groups too."""
    if hasattr(config, name):
        return getattr(config, name)
    for group in vars(config).values():
        if hasattr(group, "__dataclass_fields__") and hasattr(group, name):
            return getattr(group, name)
    raise AttributeError(name)


def _command_lines(config: UpConfig, extra: list[str] = ()) -> tuple[Mesh, dict[str, list[str]]]:
    """Every child's flags as the launcher would start it, peers on made-up ports."""
    services = [*REPLICA, "router", "gateway"]
    mesh = Mesh(config, route_flags(list(extra), services))
    for i, p in enumerate(mesh.plan):
        child = Child(p.name, [], sys.stderr, service=p.service)
        child.port = 41000 + i
        mesh.children[p.name] = child
    return mesh, {p.name: mesh._argv(p.service, p.peers, p.name) for p in mesh.plan}


def test_the_plan_has_prefill_then_decode_replicas_then_the_router_and_gateway():
    planned = plan(1, False, True, prefill=1, decode=2)
    names = [p.name for p in planned]
    assert names == [f"{s}-prefill-0" for s in REPLICA] + [f"{s}-decode-{i}" for i in range(2) for s in REPLICA] \
        + ["router", "gateway"]
    roles = {p.name: p.role for p in planned}
    assert roles["worker-prefill-0"] == roles["tokenizer-prefill-0"] == "prefill"
    assert roles["scheduler-decode-1"] == "decode" and roles["router"] == roles["gateway"] == ""
    router = next(p for p in planned if p.name == "router")
    assert router.peers == [("--prefill", ["tokenizer-prefill-0"]),
                            ("--decode", ["tokenizer-decode-0", "tokenizer-decode-1"])]
    assert planned[-1].peers == [("--tokenizer-addr", ["router"])]
    scheduler = next(p for p in planned if p.name == "scheduler-decode-1")
    assert scheduler.peers == [("--worker-addr", ["worker-decode-1"])]
    config = UpConfig(prefill=1, decode=2)
    assert not config.use_kvstore and config.starts_router and config.engine_replicas == 3
    assert plan(1, False, True, kvstore=True, prefill=1, decode=1)[0].name == "kvstore"  # --kvstore: on request


@pytest.mark.parametrize("backend", pd.TRANSFER_BACKENDS)
def test_each_child_gets_its_role_and_parses_as_its_service(backend):
    mesh, argv = _command_lines(UpConfig(prefill=1, decode=1, transfer_backend=backend))
    configs = {p.name: _parse(p.service, argv[p.name]) for p in mesh.plan}
    for side in ("prefill", "decode"):
        worker, scheduler = configs[f"worker-{side}-0"], configs[f"scheduler-{side}-0"]
        assert _field(worker, "disaggregation_mode") == _field(scheduler, "disaggregation_mode") == side
        assert _field(worker, "disaggregation_transfer_backend") == backend
        assert _field(worker, "num_threads") == worker_threads(2)  # two workers share the cores
        for service in ("tokenizer", "detokenizer"):
            assert not {"--disaggregation-mode", "--bootstrap-address"} & set(argv[f"{service}-{side}-0"])
    # The prefill scheduler listens where it says decode schedulers reach it; a decode one advertises nothing.
    listen = configs["scheduler-prefill-0"].common.listen
    host, _, port = listen.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0 and mesh.known_ports == {"scheduler-prefill-0": int(port)}
    assert _field(configs["scheduler-prefill-0"], "bootstrap_address") == listen
    assert _field(configs["scheduler-decode-0"], "bootstrap_address") == ""
    assert configs["scheduler-decode-0"].common.listen == "127.0.0.1:0"
    router = configs["router"]
    assert router.disaggregated and router.replica_addrs == []
    assert router.prefill == [mesh.children["tokenizer-prefill-0"].address]
    assert router.decode == [mesh.children["tokenizer-decode-0"].address]
    assert configs["gateway"].tokenizer_addr == mesh.children["router"].address


def test_router_flags_are_forwarded_and_pd_flags_are_the_launchers(monkeypatch, capsys):
    _, argv = _command_lines(UpConfig(prefill=2, decode=1), ["--prefill-policy", "round_robin",
                                                             "--decode-policy", "power_of_two"])
    router = _parse("router", argv["router"])
    assert (router.prefill_policy, router.decode_policy) == ("round_robin", "power_of_two")
    assert len(router.prefill) == 2 and len(router.decode) == 1
    for flag in ("--disaggregation-mode", "--disaggregation-transfer-backend", "--bootstrap-address"):
        with pytest.raises(ValueError, match=f"{flag} is set by radixmesh up --prefill/--decode"):
            pd.refuse_owned([flag, "x"])
    monkeypatch.setattr(up, "run", lambda *a: pytest.fail("the mesh must not start"))
    with pytest.raises(SystemExit):
        up.main(["--prefill", "1", "--decode", "1", "--disaggregation-mode", "decode"])
    assert "--disaggregation-mode is set by radixmesh up --prefill/--decode" in capsys.readouterr().err


def test_one_replica_of_a_mode_still_takes_the_flags_directly():
    """`up --disaggregation-mode prefill` (no --prefill/--decode): forwarded like any service flag."""
    routed = route_flags(["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "shm"],
                         ["worker", "scheduler", "detokenizer", "tokenizer"])
    assert routed["worker"] == ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "shm"]
    assert routed["scheduler"] == ["--disaggregation-mode", "prefill"]


@pytest.mark.parametrize("kwargs, message", [
    ({"prefill": 1}, r"--prefill and --decode go together: .*\(got --prefill 1 --decode 0\)"),
    ({"decode": 2}, r"--prefill and --decode go together"),
    ({"prefill": -1, "decode": 1}, r"must be >= 0"),
    ({"prefill": 1, "decode": 1, "replicas": 2}, r"replace --replicas"),
])
def test_bad_counts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UpConfig(**kwargs)


def test_an_unknown_transfer_backend_is_refused_by_the_flag():
    parser = flags_from_dataclass(UpConfig, argparse.ArgumentParser(exit_on_error=False))
    assert config_from_args(UpConfig, parser.parse_args(["--transfer-backend", "shm"])).transfer_backend == "shm"
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--transfer-backend", "carrier-pigeon"])
