"""Tests of scripts/check_layers.py (the import-layer check of `make lint`) on small fake trees in tmp_path."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_layers.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


cl = _load()


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write a fake tree: every package folder gets an __init__.py unless one is given."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for rel in list(files):
        parent = (root / rel).parent
        while parent != root:
            (parent / "__init__.py").touch(exist_ok=True)
            parent = parent.parent
    return root


def lines(root: Path) -> list[str]:
    return [str(f) for f in cl.check(root)]


def test_a_clean_tree_has_no_findings_and_exits_0(tmp_path, capsys):
    tree(tmp_path, {
        "proto/messages.py": "import msgspec\n",
        "services/common/bus.py": "from proto import messages\n",
        "services/gateway/routing.py": "from proto.messages import X\nfrom services.common import bus\n",
        "services/gateway/service.py": "from services.gateway import routing\nfrom . import routing as r\n",
        "services/cli/cli.py": "import services.gateway.service\nimport services.engine.serve.worker\n",
        "services/engine/serve/worker.py": "from services.engine.core import scheduler\n",
        "services/engine/core/scheduler.py": "import services.common.bus\n",
    })
    assert lines(tmp_path) == []
    assert cl.main(["check_layers.py", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_a_cycle_is_reported_on_every_edge_with_its_circle(tmp_path, capsys):
    tree(tmp_path, {
        "services/gateway/pages.py": "import os\nfrom services.gateway.service import GatewayService\n",
        "services/gateway/service.py": "from services.gateway import pages\n",
        "services/gateway/routing.py": "from services.gateway import pages\n",  # into the circle, not on it
    })
    circle = "services.gateway.pages -> services.gateway.service -> services.gateway.pages"
    members = "a circle of 2 modules: services.gateway.pages, services.gateway.service"
    assert lines(tmp_path) == [
        f"services/gateway/pages.py:2 services.gateway.pages -> services.gateway.service: cycle: {circle} ({members})",
        f"services/gateway/service.py:1 services.gateway.service -> services.gateway.pages: "
        f"cycle: {circle} ({members})",
    ]
    assert cl.main(["check_layers.py", str(tmp_path)]) == 1
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_a_longer_cycle_is_found_through_type_checking_and_function_local_imports(tmp_path):
    tree(tmp_path, {
        "services/engine/a.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.engine import b\n",
        "services/engine/b.py": "def f():\n    import services.engine.c\n",
        "services/engine/c.py": "from services.engine.a import thing\n",
    })
    found = lines(tmp_path)
    circle = "services.engine.a -> services.engine.b -> services.engine.c -> services.engine.a"
    assert len(found) == 3
    assert all(f"cycle: {circle} (a circle of 3 modules" in line for line in found)
    assert found[0].startswith("services/engine/a.py:3 services.engine.a -> services.engine.b [TYPE_CHECKING]: ")
    assert found[1].startswith("services/engine/b.py:2 services.engine.b -> services.engine.c [function]: ")


def test_a_module_importing_itself_is_a_cycle(tmp_path):
    tree(tmp_path, {"services/telemetry/probe.py": "from services.telemetry import probe\n"})
    assert lines(tmp_path) == [
        "services/telemetry/probe.py:1 services.telemetry.probe -> services.telemetry.probe: cycle: "
        "services.telemetry.probe -> services.telemetry.probe (a circle of a module importing itself: "
        "services.telemetry.probe)"
    ]


def test_upward_imports_are_reported_with_both_ranks(tmp_path):
    tree(tmp_path, {
        "proto/pools.py": "from services.common.runtime import env\n",
        "services/common/runtime.py": "",
        "services/engine/core/scheduler.py": "from services.engine.model.model_runner import ModelRunner\n",
        "services/engine/model/model_runner.py": "",
    })
    assert lines(tmp_path) == [
        "proto/pools.py:1 proto.pools -> services.common.runtime: "
        "layer: upward import (proto rank 0 -> services.common rank 1)",
        "services/engine/core/scheduler.py:1 services.engine.core.scheduler -> services.engine.model.model_runner: "
        "layer: upward import (services.engine.core rank 2 -> services.engine.model rank 3)",
    ]


def test_the_longest_prefix_wins(tmp_path):
    tree(tmp_path, {
        "services/engine/engine_core.py": "from services.engine.serve.frontend import PromptEncoder\n",
        "services/engine/serve/frontend.py": "from services.engine import engine_core\n",
    })
    found = lines(tmp_path)
    assert "layer: upward import (services.engine rank 5 -> services.engine.serve rank 6)" in found[-1]
    assert [line.split(": ")[1] for line in found] == ["cycle", "cycle", "layer"]
    assert cl.layer_of("services.engine.serve.frontend") == "services.engine.serve"
    assert cl.layer_of("services.engine.engine_core") == "services.engine"
    assert cl.layer_of("services.engineering") is None  # a prefix matches whole names only
    assert cl.layer_of("proto") == "proto"


@pytest.mark.parametrize(
    ("importer", "source", "imported"),
    [
        # (importer file, its text, the module the edge must reach)
        ("services/gateway/pages.py", "from .service import GatewayService\n", "services.gateway.service"),
        ("services/gateway/pages.py", "from . import service\n", "services.gateway.service"),
        ("services/gateway/pages.py", "from .. import common\n", "services.common"),
        ("services/gateway/pages.py", "from ..common.bus import connect\n", "services.common.bus"),
        ("services/gateway/__init__.py", "from . import service\n", "services.gateway.service"),
        ("services/gateway/__init__.py", "from .service import X\n", "services.gateway.service"),
        ("services/gateway/pages.py", "import services.common.bus as b\n", "services.common.bus"),
        ("services/gateway/pages.py", "from services.common.bus import connect\n", "services.common.bus"),
        ("services/gateway/pages.py", "from services.common import bus\n", "services.common.bus"),
        ("services/gateway/pages.py", "from services.common import helper\n", "services.common"),
    ],
)
def test_every_import_form_resolves_to_our_module(tmp_path, importer, source, imported):
    tree(tmp_path, {
        importer: source,
        "services/gateway/service.py": "",
        "services/common/bus.py": "",
    })
    edges = cl.find_imports(tmp_path, cl.find_modules(tmp_path))
    mine = [e for e in edges if e.path == importer]
    assert [e.imported for e in mine] == [imported]


def test_a_relative_import_breaking_a_layer_is_reported(tmp_path):
    tree(tmp_path, {
        "services/engine/kernels/rope.py": "from ..model import attention\n",
        "services/engine/model/attention.py": "",
    })
    assert lines(tmp_path) == [
        "services/engine/kernels/rope.py:1 services.engine.kernels.rope -> services.engine.model.attention: "
        "layer: upward import (services.engine.kernels rank 2 -> services.engine.model rank 3)"
    ]


def test_a_function_local_import_counts_and_is_marked(tmp_path):
    tree(tmp_path, {
        "services/common/stack.py": """\
            import asyncio


            class Stack:
                async def start(self):
                    if True:
                        from services.gateway.identity import Identities
                    return Identities
            """,
        "services/gateway/identity.py": "",
    })
    assert lines(tmp_path) == [
        "services/common/stack.py:7 services.common.stack -> services.gateway.identity [function]: "
        "layer: services never import each other (services.common [shared] -> services.gateway [gateway])"
    ]


def test_sibling_modules_of_one_layer_may_import_each_other_but_sibling_services_may_not(tmp_path):
    tree(tmp_path, {
        "services/gateway/service.py": "from services.gateway import routing, pages\n",  # same layer: allowed
        "services/gateway/routing.py": "from services.gateway.affinity import Affinity\n",
        "services/gateway/affinity.py": "from services.common import load_score\n",  # shared: allowed
        "services/common/load_score.py": "",
        "services/gateway/pages.py": "",
        "services/telemetry/views.py": "from services.gateway import routing\n",  # another service: not allowed
        "services/accounting/store.py": "import services.telemetry.views\n",
        "services/engine/core/scheduler.py": "from services.engine.kernels import rope\n",  # one rank: not allowed
        "services/engine/kernels/rope.py": "",
    })
    assert [line.split(": ", 1)[1] for line in lines(tmp_path)] == [
        "layer: services never import each other (services.accounting [accounting] -> services.telemetry [telemetry])",
        "layer: sibling layers of one rank (services.engine.core -> services.engine.kernels, rank 2)",
        "layer: services never import each other (services.telemetry [telemetry] -> services.gateway [gateway])",
    ]


def test_the_composition_root_imports_everything_and_nothing_imports_it(tmp_path):
    tree(tmp_path, {
        "services/cli/stack.py": "import services.gateway.service\nimport services.engine.serve.http\nimport proto\n",
        "services/gateway/service.py": "",
        "services/engine/serve/http.py": "",
        "services/common/runtime.py": "from services.cli import stack\n",
    })
    assert lines(tmp_path) == [
        "services/common/runtime.py:1 services.common.runtime -> services.cli.stack: "
        "layer: services.cli is the composition root; nothing imports it"
    ]


def test_a_module_the_table_does_not_place_is_reported(tmp_path):
    tree(tmp_path, {
        "services/billing/ledger.py": "from proto import messages\n",
        "proto/messages.py": "",
        "services/lonely/alone.py": "import os\n",  # in no edge: nothing to say
    })
    assert lines(tmp_path) == [
        "services/billing/ledger.py:1 services.billing.ledger -> proto.messages: "
        "layer: services.billing.ledger is in no entry of the layer table"
    ]


def test_a_custom_table_can_be_passed(tmp_path):
    tree(tmp_path, {"proto/a.py": "from services.common import b\n", "services/common/b.py": ""})
    flat = {"proto": (0, "shared"), "services.common": (0, "shared")}
    assert [line.split(": ", 1)[1] for line in map(str, cl.check(tmp_path, flat))] == [
        "layer: sibling layers of one rank (proto -> services.common, rank 0)"
    ]
    assert cl.check(tmp_path, {"proto": (1, "shared"), "services.common": (0, "shared")}) == []


def test_tests_and_other_folders_are_not_read(tmp_path):
    tree(tmp_path, {
        "tests/unit/test_x.py": "from services.gateway import service\nimport services.engine\n",
        "tools/sim.py": "from services.cli import stack\n",
        "services/gateway/service.py": "",
    })
    assert sorted(cl.find_modules(tmp_path)) == ["services", "services.gateway", "services.gateway.service"]
    assert lines(tmp_path) == []


def test_every_engine_layer_may_raise_the_engine_errors(tmp_path):
    tree(tmp_path, {
        "services/engine/errors.py": "",
        "services/engine/core/scheduler.py": "from services.engine.errors import EngineError\n",
        "services/engine/kernels/rope.py": "from ..errors import EngineError\n",
        "services/engine/model/loader.py": "from services.engine import errors\n",
        "services/gateway/upstream.py": "from services.engine.errors import EngineError\n",
    })
    assert [line.split(": ", 1)[1] for line in lines(tmp_path)] == [
        "layer: services never import each other (services.gateway [gateway] -> services.engine.errors [engine])"
    ]
