"""torchtitan with autoshard (autoshard.integrations.torchtitan): its Llama 3 debug model, as
``--module autoshard.integrations.torchtitan --config llama3_debugmodel`` builds it, trains at 2
gloo ranks like torchtitan in one process on the whole batch (loss divided by the global token
count, gradients summed, AdamW, clipping, accumulation 2), its Qwen 3 and DeepSeek-V3 debug
models take a step alike; the config resolves through
torchtitan's own ConfigManager; what autoshard cannot do yet is refused before anything changes."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan.models.llama3", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")

import torch
import torchtitan_run
from torch.distributed.tensor import DTensor

from autoshard.runtime.errors import UsageError
from autoshard.tools.launch import run_ranks

TOL = 1e-5


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run_ranks(1, torchtitan_run.train, False, "aot_eager", timeout=300)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_llama3_debug_model_trains_like_one_process(reference: dict[str, Any], compiler: str) -> None:
    two = run_ranks(2, torchtitan_run.train, True, compiler, timeout=600)[0]
    assert two["model"] == "ShardedLlama3Model"
    losses = max(abs(a - b) for a, b in zip(two["losses"], reference["losses"], strict=True))
    grads, params = _largest(two["grads"], reference["grads"]), _largest(two["params"], reference["params"])
    norms = max(abs(a - b) / b for a, b in zip(two["norms"], reference["norms"], strict=True))
    print(f"torchtitan parity ({compiler}): loss {losses:.1e}, gradients {grads:.1e}, norms {norms:.1e} (relative), "
          f"parameters {params:.1e}")
    # Gradients and norms too: AdamW's steps hardly change when every gradient is scaled alike.
    assert losses <= TOL and grads <= TOL and params <= TOL, (losses, grads, params)
    # A float32 norm is only so exact: one process's norm of the lm_head's 2048 x 256 gradient alone
    # is 9e-5 (relative) off its float64 value, the two shards' combined norm 3e-5.
    assert norms <= 2e-4, norms


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["qwen3_debugmodel", "deepseek_v3_debugmodel"])
def test_qwen3_and_deepseek_v3_debug_models_take_a_step_like_one_process(name: str) -> None:
    """One step (accumulation 2): DeepSeek-V3's experts sharded and gathered like any parameter."""
    reference = run_ranks(1, torchtitan_run.train, False, "aot_eager", name, 1, timeout=300)[0]
    two = run_ranks(2, torchtitan_run.train, True, "aot_eager", name, 1, timeout=300)[0]
    losses = abs(two["losses"][0] - reference["losses"][0])
    grads = _largest(two["grads"], reference["grads"])
    print(f"torchtitan {name}: loss {losses:.1e}, gradients {grads:.1e}")
    assert losses <= TOL and grads <= TOL, (losses, grads)


def test_the_config_resolves_through_torchtitans_command_line() -> None:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ConfigManager

    import autoshard.integrations.torchtitan as titan

    config = ConfigManager().parse_args(["--module", "autoshard.integrations.torchtitan", "--config", "llama3_debugmodel",
                                         "--training.steps", "3"])
    assert config.model_spec.parallelize_fn is titan.parallelize
    assert isinstance(config.loss, CrossEntropyLoss.Config)  # the chunked wrapper calls lm_head outside the model
    assert config.training.steps == 3
    assert callable(titan.qwen3_debugmodel) and callable(titan.deepseek_v3_debugmodel)
    with pytest.raises(AttributeError, match="llama3_debugmodel"):
        titan.llama3_no_such_flavour  # noqa: B018


def test_tensor_parallelism_is_refused_before_anything_changes() -> None:
    from torchtitan.distributed import ParallelDims

    import autoshard.integrations.torchtitan as titan

    config = titan.llama3_debugmodel()
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    with pytest.raises(UsageError, match="tensor parallelism"):
        titan.parallelize(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                          compile_config=config.compile, ac_config=config.activation_checkpoint)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert type(model).__name__ == "Llama3Model"
