"""Checkpoints of sharded training that load at any world size.

``save(path, model, optimizer, extra=...)`` writes model and optimizer state with DCP: each
rank writes only its own shards. Keys are fully qualified names (``model.<fqn>``,
``optim.state.<fqn>.exp_avg``) and tensors keep their global shapes, so ``load`` reshards (saved
on 4 ranks, loads on 1, 2 or 8) and training continues as if uninterrupted. ``extra`` (step,
scheduler, data-loader and RNG state: plain data and tensors) comes back from ``load``.
``full_state_dict(model)`` gathers one plain state dict.

Guarantees:

* **Atomic save.** Ranks write into the sibling ``.<name>.tmp``; rank 0 adds
  ``autoshard_manifest.json`` (size and CRC32 of every file) and then, after a barrier, swaps:
  ``path -> .<name>.old``, ``tmp -> path``, delete ``.old``. A crash before the swap leaves the
  previous checkpoint at ``path``; a crash between the two renames leaves it at ``.old``, where
  ``load`` finds it and the next ``save`` puts it back first. ``path`` only ever holds a
  complete checkpoint.
* **Checked load.** Before anything is read into the model, ``load`` checks every file against
  the manifest (truncation, corruption: the error names the keys stored in the bad file) and
  the checkpoint's keys, shapes and dtypes against what the model and optimizer expect (the
  error names missing, unexpected and mismatched keys). Tensors are read into temporaries and
  copied into the model and optimizer only after everything succeeded: a failed ``load``
  raises ``autoshard.CheckpointError`` (a ``ValueError``: bad or mismatched checkpoint; its
  ``CheckpointNotFoundError`` is also a ``FileNotFoundError``, its ``CheckpointReadError``, for a
  read failure, also a ``RuntimeError``) and leaves both unchanged.
* **No code runs from the checkpoint.** DCP (torch 2.13) unpickles ``.metadata`` with plain
  ``pickle.load`` and non-tensor values with ``torch.load(weights_only=False)``. Here an
  unpickler resolving only an allowlist (DCP's metadata dataclasses, ``torch.Size``, dtypes,
  layouts, paths) reads ``.metadata`` once for DCP, and non-tensor values are read with
  ``weights_only=True``. The manifest is JSON.

Checkpoints live on a file system every rank sees; load verifies each file once before DCP reads it.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    set_model_state_dict,
    set_optimizer_state_dict,
)

from autoshard._compat import DCP_METADATA_CLASSES
from autoshard.runtime.checkpoint_state import _FLAT, _local_state_dict, _state_dict, full_state_dict
from autoshard.runtime.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError, UsageError, UsageTypeError
from autoshard.runtime.fail_together import fail_together
from autoshard.runtime.shard import parameters_as_shards
from autoshard.runtime.state_shares import even_like, from_even, uneven_rows
from autoshard.runtime.strided_state import from_stored, stored_layouts, stored_like

__all__ = ["save", "load", "full_state_dict"]

_MANIFEST = "autoshard_manifest.json"
_EXTRA = "extra"  # the key of the run's other state, serialised as one blob
_METADATA = ".metadata"
_SHOW = 10  # keys named per kind of problem in an error

class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata references {module}.{name}, which is not allowed")


class _Reader(dcp.FileSystemReader):
    """Hands DCP metadata that was already read safely instead of unpickling ``.metadata``."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _Planner(dcp.DefaultLoadPlanner):
    """Reads non-tensor values (optimizer hyperparameters) as plain data only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # ours are flat

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed():
        dist.barrier(group=group)


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")


def _checksum(file: Path) -> list[int] | None:
    """``[size, crc32]`` of ``file``, or None if it cannot be read."""
    try:
        crc, size = 0, 0
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                crc, size = zlib.crc32(block, crc), size + len(block)
        return [size, crc]
    except OSError:
        return None


def _on_all_ranks(mine: list, group: dist.ProcessGroup | None) -> list:
    """Concatenate every rank's ``mine`` (in rank order) on every rank."""
    if not _distributed():
        return mine
    gathered: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine, group=group)
    return [x for part in gathered for x in part]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap(tmp: Path, path: Path, old: Path) -> None:
    """Put the complete checkpoint ``tmp`` at ``path`` (rank 0)."""
    if path.exists():
        os.replace(path, old)  # a crash from here on leaves the previous checkpoint at .old
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _pack(extra: dict[str, Any]) -> bytes:
    """``extra`` as bytes that ``torch.load(weights_only=True)`` reads back, checked now: a
    value it could not read later (a function, an arbitrary object) fails the save, not the load."""
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise UsageTypeError(f"autoshard.save: extra must be a dict with str keys, got {type(extra).__name__}; "
                             "pass e.g. extra={'step': step, 'scheduler': scheduler.state_dict()}.")
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise UsageTypeError(f"autoshard.save: extra must hold only plain data and tensors (what torch.load(weights_only=True) "
                             f"reads: numbers, strings, lists, dicts, tensors); save an object's state_dict() instead: {e}") from None
    return buffer.getvalue()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) to the directory ``path``; a collective
    on all ranks.

    ``extra``: the run's other state, e.g. ``{"step": step, "scheduler": scheduler.state_dict()}``;
    plain data and tensors, the same on every rank; :func:`load` returns it. Each rank writes
    its own shards. ``path`` is replaced atomically: until the new checkpoint
    is complete, the previous one stays loadable. An existing ``path`` that is not a checkpoint
    is never replaced (``UsageError``). ``model`` may be the sharded module or its compiled
    wrapper: the keys are the same. An existing empty directory is fine.

    If it fails on one rank, it fails on every rank within seconds (see
    :mod:`autoshard.fail_together`): the rank that failed raises its error, the others a
    ``RankFailedError`` naming it.
    """
    with fail_together("autoshard.save") as link:
        _save(Path(path), model, optimizer, extra, link.group)


def _save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None,
          group: dist.ProcessGroup | None) -> None:
    tmp, old = _siblings(path)
    rank, world = _rank_world()
    packed = None if extra is None else _pack(extra)  # before anything changes
    state = _state_dict(model, optimizer)
    if packed is not None:
        state[_EXTRA] = packed
    empty_dir = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty_dir and not (path / _MANIFEST).exists():  # checked on every rank: all raise
        raise UsageError(f"autoshard.save: {path} exists and is not an autoshard checkpoint; not replacing it "
                         "(an empty directory is fine): pass a new path or remove it.")
    if rank == 0:
        if old.exists() and not path.exists():  # an earlier save crashed between its renames
            os.replace(old, path)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    with _single_process_ok():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not _distributed(), process_group=group)
    names = sorted(p.name for p in tmp.iterdir())  # dcp.save returns once every file is written
    sums = _on_all_ranks([(n, _checksum(tmp / n)) for n in names[rank::world]], group)
    if rank == 0:
        with open(tmp / _MANIFEST, "w") as f:
            json.dump({"format": 1, "files": dict(sums)}, f)
            f.flush()
            os.fsync(f.fileno())
    _barrier(group)
    if rank == 0:
        _swap(tmp, path, old)
    _barrier(group)


def _read_checked(path: Path) -> tuple[dict[str, list[int]], Metadata]:
    """The manifest's file checksums and the (checksum-verified, safely unpickled) metadata."""
    try:
        files = json.loads((path / _MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"autoshard.load: {path} is not a complete autoshard checkpoint: no valid {_MANIFEST} ({e}); "
                         "pass a directory that autoshard.save completed.") from e
    if _checksum(path / _METADATA) != files.get(_METADATA):
        raise CheckpointError(f"autoshard.load: checkpoint {path}: {_METADATA} is missing, truncated or corrupted (checksum differs); "
                         "restore the checkpoint from a copy or load an earlier one.")
    try:
        with open(path / _METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:
        raise CheckpointError(f"autoshard.load: checkpoint {path}: cannot read {_METADATA}: {e}; load only checkpoints that "
                         "autoshard.save wrote (restore this one from a copy).") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"autoshard.load: checkpoint {path}: {_METADATA} holds {type(metadata).__name__}, not DCP Metadata; "
                         "load only checkpoints that autoshard.save wrote.")
    return files, metadata


def _listing(kind: str, keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return f"{kind} ({len(keys)}): {', '.join(keys[:_SHOW])}{more}"


def _compare(path: Path, expected: dict[str, Any], metadata: Metadata, prefixes: tuple[str, ...]) -> None:
    """Raise CheckpointError naming every key the checkpoint lacks, adds or stores differently."""
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in expected if k not in stored)
    unexpected = sorted(k for k in stored if k.startswith(prefixes) and k not in expected)
    mismatched = []
    for key, want in expected.items():
        have = stored.get(key)
        if have is None:
            continue
        if isinstance(want, torch.Tensor):
            if not isinstance(have, TensorStorageMetadata):
                mismatched.append(f"{key} (not a tensor in the checkpoint)")
            elif tuple(have.size) != tuple(want.shape) or have.properties.dtype != want.dtype:
                mismatched.append(f"{key} (checkpoint {have.properties.dtype} {list(have.size)}, "
                                  f"expected {want.dtype} {list(want.shape)})")
        elif not isinstance(have, BytesStorageMetadata):
            mismatched.append(f"{key} (a tensor in the checkpoint, expected {type(want).__name__})")
    problems = [_listing(kind, keys) for kind, keys in
                (("missing", missing), ("unexpected", unexpected), ("mismatched", sorted(mismatched))) if keys]
    if problems:
        raise CheckpointError(f"autoshard.load: checkpoint {path} does not match the model/optimizer: " + "; ".join(problems)
                         + "; build the model (and optimizer) as the saving run did, then load.")


def _verify_files(path: Path, files: dict[str, list[int]], metadata: Metadata, group: dist.ProcessGroup | None) -> None:
    """Check every data file against the manifest (each rank a share); all ranks raise alike."""
    rank, world = _rank_world()
    where: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        where.setdefault(info.relative_path, set()).add(index.fqn)
    names = sorted(set(files) | set(where))
    outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if outside:
        raise CheckpointError(f"autoshard.load: checkpoint {path}: files outside the checkpoint directory: {outside}; not reading "
                         "them: load only checkpoints that autoshard.save wrote.")
    bad = _on_all_ranks([n for n in names[rank::world] if n not in files or _checksum(path / n) != files[n]], group)
    if bad:
        keys = sorted(k for n in bad for k in where.get(n, ()))
        raise CheckpointError(f"autoshard.load: checkpoint {path}: files {bad} are missing, truncated or corrupted "
                         f"(size or CRC32 differs from {_MANIFEST}); " + _listing("keys stored there", keys)
                         + "; restore the checkpoint from a copy or load an earlier one.")


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); a collective.
    Returns the ``extra`` the checkpoint was saved with (``{}`` if none).

    The world size and sharding may differ from the saving run's: tensors are resharded. The
    checkpoint must hold exactly the model's keys (and the optimizer's, if given; optimizer
    entries are ignored when it is not), with the same global shapes and dtypes. On any error,
    ``model`` and ``optimizer`` are left unchanged. The optimizer's hyperparameters (lr, ...)
    are restored from the checkpoint, as with ``Optimizer.load_state_dict``. Parameters are
    updated in place (a compiled model and the optimizer keep working); reading goes through
    temporaries, so a rank briefly holds a second copy of its shards and optimizer state.
    A failure on one rank fails every rank within seconds, as with :func:`save`.
    """
    with fail_together("autoshard.load") as link:
        return _load(Path(path), model, optimizer, link.group)


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup | None) -> dict[str, Any]:
    old = _siblings(path)[1]
    if not (path / _MANIFEST).exists() and old.exists():
        path = old  # a save crashed after moving the previous checkpoint aside
    if not path.exists():
        raise CheckpointNotFoundError(f"autoshard.load: no checkpoint at {path}; pass the directory given to autoshard.save.")
    fresh = optimizer is not None and not optimizer.state
    grads = {}
    if fresh:  # DCP initialises empty optimizer state with a zero-lr step, which needs no grads
        grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
        for p in grads:
            p.grad = None
    try:
        expected = _local_state_dict(model, optimizer)
        uneven = uneven_rows(expected)  # cut by state shares: read in the even layout, then cut back (collective: first)
        files, metadata = _read_checked(path)
        expected.update({k: even_like(expected[k]) for k in uneven})
        layouts = stored_layouts(expected)  # tensor parallelism's fused projections: read as blocks, then cut back
        strided = {k: expected[k].placements for k in layouts}
        expected.update({k: stored_like(expected[k], placements) for k, placements in layouts.items()})
        _compare(path, expected, metadata, ("model.", "optim.") if optimizer is not None else ("model.",))
        _verify_files(path, files, metadata, group)
        loaded = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in expected.items()}
        if isinstance(metadata.state_dict_metadata.get(_EXTRA), BytesStorageMetadata):
            loaded[_EXTRA] = b""
        try:
            with _single_process_ok():
                dcp.load(loaded, storage_reader=_Reader(path, metadata), planner=_Planner(), no_dist=not _distributed(),
                         process_group=group)
        except dcp.CheckpointException as e:  # a BaseException: make it an ordinary error
            raise CheckpointReadError(f"autoshard.load: reading checkpoint {path} failed: {e}; the model and optimizer are "
                                      "unchanged: fix what DCP reports and load again.") from None
    except BaseException:
        if fresh:
            optimizer.state.clear()  # back to the empty state it had
        raise
    finally:
        for p, g in grads.items():
            p.grad = g
    extra = torch.load(io.BytesIO(loaded[_EXTRA]), weights_only=True) if _EXTRA in loaded else {}
    loaded.update({k: from_even(loaded[k], rows) for k, rows in uneven.items()})
    loaded.update({k: from_stored(loaded[k], placements) for k, placements in strided.items()})
    with parameters_as_shards():
        set_model_state_dict(model, {k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")})
        if optimizer is not None:
            optim = {k[len("optim."):]: v for k, v in loaded.items() if k.startswith("optim.")}
            set_optimizer_state_dict(model, optimizer, optim, options=_FLAT)
    return extra
