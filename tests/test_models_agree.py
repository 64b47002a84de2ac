"""One step, three readers: the step model (passes/step_model.py, what the schedule decides by),
the keep pass's estimate (passes/keep.py, what the budget keeps blocks by) and the simulator
(autoshard/cost/, what the report shows and the planner compares) must tell the same story
of the same graphs. Each keeps its own rules where it needs them; these tests hold them to one
another on real traced graphs (the tests' GPT, compiled on the fake process group):

- storage aliases: the three walkers (:class:`Storages`, :func:`storage_roots`, the simulator's
  ``Liveness``) put the same nodes in the same storage on every stage a pass or the simulator
  reads;
- peak memory: the keep pass's estimate is the simulator's peak where the final graphs run in
  graph order; the step model's and the simulator's peaks of one graph agree
  (tests/test_cost_model.py, ``test_the_step_model_and_the_simulator_agree_on_a_graphs_peak``);
- time: the step model's predicted time of a graph is the simulator's.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

from autoshard._compat import c10d
from autoshard.cost.cost_model import schedule_config
from autoshard.cost.liveness import Liveness
from autoshard.cost.simulator import analyze
from autoshard.passes.gloo import gathers_into_buffers
from autoshard.passes.graph_utils import PARAMS, nbytes, positions, wait_of
from autoshard.passes.keep import _LiveBytes, needed_first
from autoshard.passes.step_model import Storages, peak_bytes, step_time, storage_roots

from fake_pg import compile_step, fake_world, same_tokens
from gpt import GPT, GPTConfig

pytestmark = pytest.mark.planner

WORLD = 8
# The stages the walkers read: the joint graphs (keep), the bucketed ones (the schedule), the final
# ones (the simulator, the gloo passes). Not "captured": Dynamo's graph, which no walker reads.
STAGES = ("joint", "lowered", "forward_bucketed", "forward", "backward_bucketed", "backward")


@pytest.fixture(scope="module")
def gpt_stages() -> dict[str, dict[str, fx.GraphModule]]:
    """profile -> the GPT's stages compiled with that profile (default schedule)."""
    found = {}
    for profile in ("h100", "cpu"):
        (found[profile],) = compile_step("gpt", world_size=WORLD, options={"profile": profile}).graphs.compiled
    yield found
    torch._dynamo.reset()


def _storages(nodes: list[fx.Node], storage_of) -> set[frozenset[str]]:
    """The nodes grouped by the storage ``storage_of(node)`` says they use."""
    groups: dict[object, set[str]] = {}
    for n in nodes:
        groups.setdefault(storage_of(n), set()).add(n.name)
    return {frozenset(g) for g in groups.values()}


def _walkers_disagree(gm: fx.GraphModule) -> dict[str, set[frozenset[str]]]:
    nodes = list(gm.graph.nodes)
    model, passes = Storages(nodes).root, storage_roots(gm.graph)
    live = Liveness([("forward", n) for n in nodes], {})
    # The simulator gives a node one storage per output element (a split's pieces share one).
    by_model = _storages(nodes, model.__getitem__)
    return {"storage_roots": by_model ^ _storages(nodes, passes.__getitem__),
            "Liveness": by_model ^ _storages(nodes, lambda n: frozenset(live.of.get(n, ())) or n)}


@pytest.mark.parametrize("profile", ["h100", "cpu"])
@pytest.mark.parametrize("name", STAGES)
def test_the_storage_walkers_agree_on_every_stage(gpt_stages, profile, name):
    assert _walkers_disagree(gpt_stages[profile][name]) == {"storage_roots": set(), "Liveness": set()}


@pytest.mark.parametrize("name", ["forward", "backward"])
def test_the_storage_walkers_agree_on_gathers_into_buffers(gpt_stages, name):
    """The final graphs as the gloo passes leave them: gathers write into ``empty`` buffers,
    whose storage the gather's result and its views use."""
    gm = gpt_stages["cpu"][name]
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    with fake_world(WORLD):
        gathers_into_buffers(gm, lambda group: True)
    assert any(n.target is c10d.all_gather_into_tensor_out.default for n in gm.graph.nodes)
    assert _walkers_disagree(gm) == {"storage_roots": set(), "Liveness": set()}


@pytest.mark.parametrize("profile", ["h100", "cpu"])
@pytest.mark.parametrize("side", ["forward", "backward"])
def test_the_step_models_time_is_the_simulators(gpt_stages, profile, side):
    """One graph played alone: the step model's time (one comm stream) is the simulator's (a
    stream per process group; the GPT at world size 8 has one group), on the same profile."""
    gm = gpt_stages[profile][side]
    predicted = step_time(list(gm.graph.nodes), schedule_config(profile))
    assert predicted > 0
    assert predicted == pytest.approx(analyze(gm, None, profile).step_time, rel=1e-12, abs=0)


# The keep pass's estimate, on the 4-block GPT of tests/test_keep.py compiled with schedule
# "none": the final graphs run in the joint graph's order, so the estimate and the simulator's
# peak of the same step can be compared number for number.
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
_tokens = same_tokens(lambda: torch.zeros(2, 16, dtype=torch.long))


def _keep_and_simulate(**options) -> tuple[int, int]:
    """(the keep pass's estimate for the parameters the compile kept, the simulator's peak of
    the final graphs), ``options`` passed to the backend."""
    (stages,) = compile_step(lambda: GPT(CFG), _tokens, world_size=WORLD, options={"schedule": "none", **options}).graphs.compiled
    joint = stages["lowered"]
    fulls = {n.meta[PARAMS][0]: wait_of(n) for n in joint.graph.nodes if n.target is c10d.all_gather_into_tensor.default}
    keep = {None: needed_first(fulls, positions(joint.graph.nodes)), False: set(fulls), True: set()}[options.get("reshard_after_forward")]
    live = _LiveBytes(joint.graph, fulls)
    return live.peak(keep), analyze(stages["forward"], stages["backward"], "h100").peak_bytes


def test_the_keep_estimate_is_the_simulators_peak():
    # The default (the backward's first block kept) and every block kept: the same number.
    estimate, simulated = _keep_and_simulate()
    assert estimate == simulated
    estimate, simulated = _keep_and_simulate(reshard_after_forward=False)
    assert estimate == simulated
    # Nothing kept: the estimate's peak sits where the last block's reduction runs, which it
    # prices at two blocks' full bytes (the flat copy and as many received); the bucketed
    # reduce-scatter receives a rank's share, so the simulated peak is lower, by under 5%.
    estimate, simulated = _keep_and_simulate(reshard_after_forward=True)
    assert simulated < estimate <= 1.05 * simulated


def test_the_keep_estimate_is_the_step_models_peak_of_the_joint_graph():
    """Every parameter kept, the estimate is the step model's peak of the joint graph itself,
    but for the tangents, which the estimate counts as 0 bytes (the loss's: 4 bytes)."""
    (stages,) = compile_step(lambda: GPT(CFG), _tokens, world_size=WORLD, options={"schedule": "none"}).graphs.compiled
    joint = stages["lowered"]
    fulls = {n.meta[PARAMS][0]: wait_of(n) for n in joint.graph.nodes if n.target is c10d.all_gather_into_tensor.default}
    tangents = sum(nbytes(n) for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents"))
    assert _LiveBytes(joint.graph, fulls).peak(set(fulls)) + tangents == peak_bytes(list(joint.graph.nodes))[0]
