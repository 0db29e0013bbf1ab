"""The transport contract is explicit: what the runtime uses of a transport, a round handle or a
coordinator is declared in its protocol, and both implementations define all of it with the
protocol's parameters. The behaviour behind each member runs in
tests/integration/test_transport_suite.py against both backends."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from comms import transport as contract
from comms.means import MeanRound
from comms.p2p.transport import P2PTransport
from comms.torchdist.transport import TorchTransport
from mesh.runtime import session

ROOT = Path(__file__).resolve().parents[2]


def _members(protocol: type) -> dict[str, object]:
    """The protocol's own members (methods and properties), its bases' included."""
    out: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                out[name] = value
    return out


def _params(fn: object) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]


CASES = [
    (contract.Transport, TorchTransport),
    (contract.Transport, P2PTransport),
    (contract.DirectoryTransport, P2PTransport),
    (contract.MeanHandle, MeanRound),
    (session.Coordinator, session.StaticCoordinator),
    (session.Coordinator, session.DhtCoordinator),
]


@pytest.mark.parametrize(("protocol", "impl"), CASES, ids=lambda c: c.__qualname__)
def test_each_implementation_defines_the_whole_protocol(protocol: type, impl: type) -> None:
    members = _members(protocol)
    assert members, protocol
    for name, declared in members.items():
        got = inspect.getattr_static(impl, name, None)
        assert got is not None, f"{impl.__qualname__} lacks {protocol.__qualname__}.{name}"
        if isinstance(declared, property):
            assert isinstance(got, property), f"{impl.__qualname__}.{name} is not a property"
            continue
        want = _params(declared)
        have = _params(got)
        # an implementation may add trailing optional parameters, never rename or drop one
        assert have[: len(want)] == want, (impl.__qualname__, name, have, want)
    for name in getattr(protocol, "__annotations__", {}):  # declared attributes
        assert hasattr(impl, name) or name in _instance_attributes(impl), (impl, name)


def _instance_attributes(impl: type) -> set[str]:
    """Attributes the class or its mixins assign on self (where a data member is set)."""
    ours = [k for k in impl.__mro__ if k.__module__.split(".")[0] in ("comms", "mesh")]
    trees = [ast.parse(inspect.getsource(k).strip()) for k in ours]
    return {
        t.attr
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_the_torch_round_can_be_cut() -> None:
    """A round over the links ends with what arrived when the runtime cuts it, as on hivemind
    (no collective that must wait for every member)."""
    assert MeanRound("g", 0, ("a", "b"), deadline=0.0).cut() is True


RUNTIME_OBJECTS = {"transport", "handle", "coord", "self.transport", "self.coord"}


def test_the_runtime_asks_nothing_outside_the_contract() -> None:
    """No getattr/hasattr probing of a transport, a round handle or a coordinator in mesh/:
    what the runtime needs is declared (a probe hides a missing member until a run hits it)."""
    found = []
    for path in (ROOT / "mesh").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id in ("getattr", "hasattr") and node.args:
                if ast.unparse(node.args[0]) in RUNTIME_OBJECTS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
