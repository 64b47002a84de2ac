"""Hugging Face Trainer with autoshard (autoshard.integrations.hf.AutoshardTrainer): a
transformers Llama trained at 2 gloo ranks matches the plain Trainer in one process on the
whole batch (gradient accumulation 2, clipping by the global norm, torch_compile=True
compiling once); save_model writes weights from_pretrained loads in one process; a checkpoint
saved at 2 ranks resumes at 1 rank with the uninterrupted run's losses."""
from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")
pytest.importorskip("accelerate", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")

import torch
import transformers as tf

from autoshard.tools.launch import run_ranks

import hf_run

TOL = 1e-5
COMPILED = {"torch_compile": True, "torch_compile_backend": "aot_eager", "save_strategy": "steps", "save_steps": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    reference = run_ranks(1, hf_run.reference, str(root / "reference"), timeout=600)[0]
    two = run_ranks(2, hf_run.sharded, str(root / "two"), None, COMPILED, timeout=600)
    resumed = run_ranks(1, hf_run.sharded, str(root / "resumed"), str(root / "two" / "checkpoint-2"),
                        {"torch_compile": True, "torch_compile_backend": "aot_eager"}, timeout=600)[0]
    return {"root": root, "reference": reference, "two": two[0], "resumed": resumed}


def _max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_two_ranks_train_like_the_trainer_in_one_process(runs: dict[str, Any]) -> None:
    ref, two = runs["reference"], runs["two"]
    assert len(ref["losses"]) == 4
    print(f"hf parity: loss {_max_difference(two['losses'], ref['losses']):.1e}, "
          f"grad norm {_max_difference(two['norms'], ref['norms']):.1e}")
    assert _max_difference(two["losses"], ref["losses"]) <= TOL, (two["losses"], ref["losses"])
    # max_grad_norm=0.1 clips every step (the norms are far above it), by the global norm.
    assert min(ref["norms"]) > 1.0 and _max_difference(two["norms"], ref["norms"]) <= 1e-4, (two["norms"], ref["norms"])
    assert max((two["state"][k] - v).abs().max().item() for k, v in ref["state"].items()) <= TOL
    assert two["compiled_once"] and not two["ddp"]


def test_save_model_loads_with_from_pretrained_in_one_process(runs: dict[str, Any]) -> None:
    final = runs["root"] / "two" / "final"
    assert (final / "model.safetensors").is_file()
    model = tf.AutoModelForCausalLM.from_pretrained(final)
    assert type(model) is tf.LlamaForCausalLM and model.config.architectures == ["LlamaForCausalLM"]
    with torch.no_grad():
        logits = model(input_ids=hf_run.PROBE).logits
    assert (logits - runs["two"]["logits"]).abs().max().item() <= 1e-6


def test_checkpoint_from_two_ranks_resumes_at_one_with_the_same_losses(runs: dict[str, Any]) -> None:
    assert os.path.isdir(runs["root"] / "two" / "checkpoint-2" / "autoshard")
    resumed, two = runs["resumed"], runs["two"]
    assert _max_difference(resumed["losses"], two["losses"][2:]) <= TOL, (resumed["losses"], two["losses"])
    assert max((resumed["state"][k] - v).abs().max().item() for k, v in two["state"].items()) <= TOL
