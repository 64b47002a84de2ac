"""Lightning with autoshard (autoshard.integrations.lightning): Fabric (strategy="autoshard")
and the Trainer (a LightningModule built in configure_model) train the tests' GPT at 2 gloo
ranks like Lightning in one process on the whole batch, with gradient accumulation 2 through
Lightning's own sync blocking; checkpoints saved at 2 ranks resume at 1 rank."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")

from autoshard.tools.launch import run_ranks

import lightning_run

TOL = 1e-5


def _difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    assert len(a["losses"]) == len(b["losses"]), (a["losses"], b["losses"])
    losses = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    params = max((a["params"][k] - v).abs().max().item() for k, v in b["params"].items())
    return losses, params


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fabric")
    return {"reference": run_ranks(1, lightning_run.fabric_train, False, timeout=300)[0],
            "two": run_ranks(2, lightning_run.fabric_train, True, str(root / "ckpt"), timeout=300)[0],
            "resumed": run_ranks(1, lightning_run.fabric_train, True, None, str(root / "ckpt"), timeout=300)[0]}


def test_fabric_trains_like_one_process(fabric: dict[str, Any]) -> None:
    assert fabric["two"]["strategy"] == "AutoshardFabricStrategy"
    losses, params = _difference(fabric["two"], fabric["reference"])
    print(f"fabric parity: loss {losses:.1e}, parameters {params:.1e}")
    assert losses <= TOL and params <= TOL, (losses, params)


def test_fabric_checkpoint_from_two_ranks_resumes_at_one(fabric: dict[str, Any]) -> None:
    resumed, two = fabric["resumed"], fabric["two"]
    done = 2 * lightning_run.ACCUMULATION  # micro-batches of the 2 steps before the checkpoint
    assert len(resumed["losses"]) == len(two["losses"]) - done
    assert max(abs(x - y) for x, y in zip(resumed["losses"], two["losses"][done:])) <= TOL
    assert max((resumed["params"][k] - v).abs().max().item() for k, v in two["params"].items()) <= TOL


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer")
    runs = {"reference": run_ranks(1, lightning_run.trainer_train, False, str(root / "reference"), timeout=300)[0],
            "two": run_ranks(2, lightning_run.trainer_train, True, str(root / "two"), timeout=300)[0]}
    # Lightning's own resume in one process, from its own checkpoint: what autoshard's resume must match.
    runs["reference_resumed"] = run_ranks(1, lightning_run.trainer_train, False, str(root / "reference_resumed"),
                                          str(root / "reference" / "step=2.ckpt"), timeout=300)[0]
    runs["resumed"] = run_ranks(1, lightning_run.trainer_train, True, str(root / "resumed"), str(root / "two" / "step=2.ckpt"),
                                timeout=300)[0]
    return runs


def test_trainer_trains_like_one_process(trainer: dict[str, Any]) -> None:
    assert trainer["two"]["strategy"] == "AutoshardStrategy"
    assert trainer["two"]["checkpoints"] == ["step=2.ckpt", "step=4.ckpt"]
    losses, params = _difference(trainer["two"], trainer["reference"])
    print(f"lightning trainer parity: loss {losses:.1e}, parameters {params:.1e}")
    assert losses <= TOL and params <= TOL, (losses, params)


def test_trainer_checkpoint_from_two_ranks_resumes_at_one_as_lightning_resumes(trainer: dict[str, Any]) -> None:
    # (Lightning's resume from an epoch's end replays its loop counters, not exactly the
    # uninterrupted run's steps: the comparison is with Lightning's own resume.)
    losses, params = _difference(trainer["resumed"], trainer["reference_resumed"])
    assert losses <= TOL and params <= TOL, (losses, params)
