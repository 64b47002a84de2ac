"""State of a 2-D (dp x tp) sharded model: ``parallelize_module(model, mesh["tp"], plan)`` then
``autoshard.shard(model, mesh["dp"])``.

Checkpoints: saved on dp 2 x tp 2 (trained compiled, aot_eager), loaded on 2 x 2, on 1-D 4 ranks, on 1-D 2 ranks and in one
process without a process group; saved on 1-D 4 ranks, loaded on 2 x 2: training goes on with
the losses of one process that never stopped (1e-5). ``full_state_dict`` of a 2-D model is the
unsharded model's state dict. Meta-device init, parallelised, sharded and materialised, draws
the values of the model built on the CPU with the same seed. Layouts in one process on the fake
group: this rank's piece of a strided 2-D placement, and which layouts a checkpoint stores as
blocks (a dimension sharded twice, both strided, refused).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import train_losses
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import autoshard
from autoshard._compat.dtensor import StridedShard
from autoshard.runtime.errors import UsageError
from autoshard.runtime.layout import local_chunk
from autoshard.runtime.strided_state import stored_placements
from autoshard.tools.launch import run_ranks

from fake_pg import fake_world
from gpt import GPT, GPTConfig
from models import build

STEPS, SAVE_AT, TOL = 4, 2, 1e-5
CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)  # models.build("gpt")


# Layouts in one process ------------------------------------------------------------------------

@pytest.mark.parametrize("rank", range(4))
def test_local_chunk_cuts_strided_and_two_dimensional_placements_as_dtensor_does(rank):
    with fake_world(4, rank):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = divmod(rank, 2)
        full = torch.arange(12 * 6).view(12, 6)
        # A column-parallel weight sharded over dp: tp's halves first, each then cut over dp.
        colwise = local_chunk(full, mesh, [StridedShard(0, split_factor=2), Shard(0)])
        assert torch.equal(colwise, full[6 * tp + 3 * dp: 6 * tp + 3 * dp + 3])
        # A row-parallel weight: rows over dp, columns over tp.
        rowwise = local_chunk(full, mesh, [Shard(0), Shard(1)])
        assert torch.equal(rowwise, full[6 * dp: 6 * dp + 6, 3 * tp: 3 * tp + 3])
        # A fused projection (q, k, v of 4 rows each), replicated over dp: its tp-th half of each part.
        fused = local_chunk(full, mesh, [Replicate(), StridedShard(0, split_factor=3)])
        parts = [full[4 * i + 2 * tp: 4 * i + 2 * tp + 2] for i in range(3)]
        assert torch.equal(fused, torch.cat(parts))
        # The 1-D fast path is unchanged: a view of this rank's rows, also for state shares.
        flat = init_device_mesh("cpu", (4,))
        assert local_chunk(full, flat, [Shard(0)]).data_ptr() == full[3 * rank].data_ptr()
        assert torch.equal(local_chunk(full, flat, [Shard(0)], rows=(6, 2, 2, 2)), full[[0, 6, 8, 10][rank]:][:(6, 2, 2, 2)[rank]])
        with pytest.raises(UsageError, match="state shares"):
            local_chunk(full, mesh, [Shard(0), Shard(1)], rows=(6, 6))


def test_a_checkpoint_stores_strided_pieces_that_are_not_one_block_as_blocks():
    sizes = (2, 2)
    # FSDP2's layout of a column-parallel weight is one block per rank: stored as it is.
    assert stored_placements("fc.weight", (StridedShard(0, split_factor=2), Shard(0)), sizes) is None
    assert stored_placements("proj.weight", (Shard(0), Shard(1)), sizes) is None
    # A fused projection's heads of q, k and v are three pieces: stored as tp's plain Shard(0).
    assert stored_placements("qkv.weight", (Replicate(), StridedShard(0, split_factor=3)), sizes) == (Replicate(), Shard(0))
    with pytest.raises(UsageError, match=r"'w' is laid out .*sharded twice with _StridedShard both times"):
        stored_placements("w", (StridedShard(0, split_factor=2), StridedShard(0, split_factor=3)), sizes)


# Four gloo ranks -------------------------------------------------------------------------------

def _adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _two_d(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], autoshard.gpt_tp_plan(model))
    return autoshard.shard(model, mesh["dp"])


def _resumed(path: str, layout: str) -> dict:
    """Load ``path`` into a differently initialised model in ``layout``, train to STEPS."""
    model = build("gpt", seed=1)
    model = _two_d(model) if layout == "2d" else autoshard.shard(model)
    opt = _adamw(model, lr=0.5)  # the checkpoint's lr (1e-3) must replace this one
    autoshard.load(path, model, opt)
    dp, dp_size = (dist.get_rank() // 2, 2) if layout == "2d" else (dist.get_rank(), dist.get_world_size())
    return {"after": train_losses(model, opt, range(SAVE_AT, STEPS), slices=(dp, dp_size)), "params": autoshard.full_state_dict(model)}


def _meta_init() -> dict[str, bool]:
    """Meta device, parallelised, sharded, materialised: each rank's pieces equal those of the
    model built on the CPU with the same seed (and their gathered whole its parameters)."""
    torch.manual_seed(0)  # build("gpt")'s seed
    with torch.device("meta"):
        model = GPT(GPTConfig(**CONFIG))
    _two_d(model)
    assert all(p.to_local().is_meta for p in model.parameters())
    autoshard.materialize(model, "cpu", init=GPT.init_weights)
    reference, plain = _two_d(build("gpt")), build("gpt")
    out = {}
    for (name, p), q, r in zip(model.named_parameters(), reference.parameters(), plain.parameters(), strict=True):
        assert p.placements == q.placements, name
        out[name] = torch.equal(p.to_local(), q.to_local()) and torch.equal(p.full_tensor(), r.detach())
    return out


def _four_ranks(tmp: str) -> dict:
    rank = dist.get_rank()
    c2d, c1d = f"{tmp}/c2d", f"{tmp}/c1d"
    out: dict = {"meta_init": _meta_init()}
    model = _two_d(build("gpt"))
    out["full_state_dict_at_start"] = autoshard.full_state_dict(model)
    opt = _adamw(model)
    # Trained compiled and saved through the compiled wrapper, as a training script does.
    compiled = torch.compile(model, backend="autoshard", options={"compiler": "aot_eager"})
    out["before"] = train_losses(compiled, opt, range(SAVE_AT), slices=(rank // 2, 2))
    autoshard.save(c2d, compiled, opt)
    out["full_state_dict_at_save"] = autoshard.full_state_dict(model)
    after = train_losses(compiled, opt, range(SAVE_AT, STEPS), slices=(rank // 2, 2))
    out["2d"] = {"after": after, "params": autoshard.full_state_dict(model)}
    out["2d_from_2d"] = _resumed(c2d, "2d")
    # 2-D -> 1-D at 4 ranks; that 1-D model saved at once (a 1-D checkpoint) and loaded on 2 x 2.
    flat = autoshard.shard(build("gpt", seed=1))
    flat_opt = _adamw(flat, lr=0.5)
    autoshard.load(c2d, flat, flat_opt)
    autoshard.save(c1d, flat, flat_opt)
    after = train_losses(flat, flat_opt, range(SAVE_AT, STEPS), slices=(rank, 4))
    out["1d4_from_2d"] = {"after": after, "params": autoshard.full_state_dict(flat)}
    out["2d_from_1d4"] = _resumed(c1d, "2d")
    # 2-D -> 1-D at 2 ranks: a new group of ranks 0 and 1.
    dist.destroy_process_group()
    try:
        if rank < 2:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/pg_2", rank=rank, world_size=2)
            out["1d2_from_2d"] = _resumed(c2d, "1d")
            dist.destroy_process_group()
    finally:  # the group run_ranks destroys
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg_4", rank=rank, world_size=4)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp_state")
    model = build("gpt")
    opt = _adamw(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    losses = train_losses(model, opt, range(SAVE_AT), slices=(0, 1))
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    losses += train_losses(model, opt, range(SAVE_AT, STEPS), slices=(0, 1))
    reference = {"losses": losses, "start": start, "at_save": at_save, "params": model.state_dict()}
    ranks = run_ranks(4, _four_ranks, str(tmp), timeout=400)
    # Loaded in one process without a process group (unsharded).
    plain = build("gpt", seed=1)
    plain_opt = _adamw(plain, lr=0.5)
    autoshard.load(str(tmp / "c2d"), plain, plain_opt)
    no_group = {"after": train_losses(plain, plain_opt, range(SAVE_AT, STEPS), slices=(0, 1)), "params": plain.state_dict()}
    return {"reference": reference, "ranks": ranks, "no_group_from_2d": no_group}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_resumed(result: dict, reference: dict) -> None:
    losses = reference["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(result["after"], losses, strict=True)) < TOL, (result["after"], losses)
    assert _close(result["params"], reference["params"]) < TOL


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("run", ["2d", "2d_from_2d", "1d4_from_2d", "1d2_from_2d", "2d_from_1d4"])
def test_a_checkpoint_loads_across_2d_and_1d_layouts_and_training_continues_as_if_uninterrupted(runs, run) -> None:
    reference = runs["reference"]
    for out in runs["ranks"]:
        assert max(abs(a - b) for a, b in zip(out["before"], reference["losses"][:SAVE_AT], strict=True)) < TOL
    _check_resumed(runs["ranks"][0][run], reference)  # rank 0: losses are global, full_state_dict is rank 0's


@pytest.mark.slow
@pytest.mark.multirank
def test_a_2d_checkpoint_loads_in_one_process_without_a_group(runs) -> None:
    _check_resumed(runs["no_group_from_2d"], runs["reference"])


@pytest.mark.slow
@pytest.mark.multirank
def test_full_state_dict_of_a_2d_model_is_the_unsharded_state_dict(runs) -> None:
    reference = runs["reference"]
    first, *others = runs["ranks"]
    start = first["full_state_dict_at_start"]
    assert start.keys() == reference["start"].keys()
    assert all(torch.equal(start[k], reference["start"][k]) for k in start)  # exactly: nothing computed yet
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in start.values())
    assert _close(first["full_state_dict_at_save"], reference["at_save"]) < TOL
    plain = build("gpt", seed=1)
    plain.load_state_dict(first["full_state_dict_at_save"], strict=True)
    assert all(out["full_state_dict_at_start"] == {} for out in others)  # rank0_only


@pytest.mark.slow
@pytest.mark.multirank
def test_meta_init_of_a_2d_model_equals_building_it_on_the_cpu(runs) -> None:
    for out in runs["ranks"]:
        assert out["meta_init"] and all(out["meta_init"].values()), [n for n, ok in out["meta_init"].items() if not ok]
