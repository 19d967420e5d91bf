"""A run's trained weights, read back into a freshly built policy: ``policy.init`` (an RL
run that starts from an SFT run's policy) and ``dvla eval``.

:func:`read_weights` takes a run directory (its newest weights: ``weights.safetensors``
or its newest valid checkpoint, whichever holds the higher version; a base directory
means its ``latest`` run), a checkpoint directory (``checkpoints/step-N``) or a
``.safetensors`` file. :func:`fit_policy` loads them into a policy after checking the
policy name recorded with them and every tensor's name and shape. Every problem is one
:class:`~dvla.config.ConfigError` line that names the path and what does not fit.

The normalisation an SFT run trained with (:mod:`dvla.normalize`: the ``normalization`` entry
of the weights' metadata or of a checkpoint's manifest, else ``normalization.json`` in the run
directory, else, for a run that records none, that of the run its ``policy.init`` names) comes
with the weights, and :func:`fit_policy` installs it as ``policy.normalizer``. An RL run stores
it in all three places itself; :func:`resumed_normalization` is what ``run.resume`` restores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dvla.state.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointManager, section
from dvla.config import ConfigError
from dvla.normalize import FILE as NORM_FILE, METADATA_KEY as NORM_KEY, Normalizer
from dvla.state.rundir import resolve_run_arg

WEIGHTS_FILE = "weights.safetensors"
_SHOWN = 3  # mismatched tensors named in an error


@dataclass
class StoredWeights:
    path: Path  # the file or checkpoint directory read
    tensors: dict[str, Tensor]  # named as the policy's state dict names them
    policy: str | None  # the registry name it was saved from (None: not recorded)
    version: int | None  # the update that made them (None: not recorded)
    normalization: Normalizer | None = None  # what an SFT run normalised with (dvla.normalize)

    def describe(self) -> str:
        return (f"{self.path} (policy {self.policy or 'unrecorded'}, version "
                f"{self.version if self.version is not None else 'unrecorded'})")


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _file_version(path: Path) -> int | None:
    """The version in a safetensors file's metadata (None when unreadable or absent)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return int((f.metadata() or {}).get("version"))
    except Exception:
        return None


def _from_file(path: Path, what: str) -> StoredWeights:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # not safetensors, truncated, unreadable
        raise ConfigError(f"{what}: {path} is not a readable safetensors file ({_one_line(exc)})") from None
    if any(k.startswith("policy/") for k in tensors):
        tensors = section(tensors, "policy/")  # a checkpoint's tensors file
    try:
        version = int(meta["version"]) if "version" in meta else int(meta["step"]) if "step" in meta else None
    except ValueError:
        version = None
    norm = _normalization(meta[NORM_KEY], path, what) if NORM_KEY in meta else None
    return StoredWeights(path, tensors, meta.get("policy"), version, norm)


def _normalization(text: str, where: Path, what: str) -> Normalizer:
    try:
        return Normalizer.from_json(text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what}: {where} holds an unreadable normalisation ({_one_line(exc)})") from None


def _manifest_normalization(manifest: dict, where: Path, what: str) -> Normalizer | None:
    """The ``normalization`` entry of a checkpoint's manifest (an RL run's: its text, or null
    where the run had none); None where it has no such entry."""
    text = manifest.get(NORM_KEY)
    if text is None:
        return None
    if not isinstance(text, str):
        raise ConfigError(f"{what}: {where} holds an unreadable normalisation (a {type(text).__name__}, not "
                          "the text of a normalisation record)")
    return _normalization(text, where, what)


def _config_init(run: Path) -> str | None:
    """``policy.init`` of the run's ``config.yaml`` (None: unset or unreadable)."""
    import yaml

    try:
        return ((yaml.safe_load((run / "config.yaml").read_text()) or {}).get("policy") or {}).get("init")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def _init_normalization(init: str | None, run: Path, what: str, depth: int) -> Normalizer | None:
    """The normalisation of the run ``init`` (a run's ``policy.init``) names, where it exists."""
    src = resolve_run_arg(Path(init).expanduser()) if init and depth < 4 else None
    if src is None or not src.exists():
        return None
    src_run = src.parent if src.is_file() else src.parent.parent if (src / MANIFEST_FILE).is_file() else src
    if src_run.resolve() == run.resolve():
        return None
    return _with_run_normalization(StoredWeights(src, {}, None, None), src_run, what, depth + 1).normalization


def _with_run_normalization(stored: StoredWeights, run: Path, what: str, depth: int = 0) -> StoredWeights:
    """``stored`` with ``run/normalization.json`` where its weights carry none, else with the
    normalisation of the run it started from (its config's ``policy.init``: a run written
    before RL runs kept their own), where that still exists."""
    f = run / NORM_FILE
    if stored.normalization is None and f.is_file():
        stored.normalization = _normalization(f.read_text(), f, what)
    if stored.normalization is None and (run / "config.yaml").is_file():
        stored.normalization = _init_normalization(_config_init(run), run, what, depth)
    return stored


def _from_checkpoint(manager: CheckpointManager, path: Path | None, what: str) -> StoredWeights:
    try:
        ck = manager.load(path) if path is not None else manager.load_latest()
    except CheckpointError as exc:
        raise ConfigError(f"{what}: {_one_line(exc)}") from None
    name = ((ck.manifest.get("config") or {}).get("policy") or {}).get("name")
    return StoredWeights(ck.path, section(ck.tensors, "policy/"), name, int(ck.step),
                         _manifest_normalization(ck.manifest, ck.path, what))


def resumed_normalization(manifest: dict, checkpoint: Path, run: Path, what: str = "run.resume") -> Normalizer | None:
    """The normalisation a run resumed from ``checkpoint`` (its ``manifest``) acts with: the
    one the checkpoint records (None where it records that the run had none). A checkpoint
    written before checkpoints carried it: ``run/normalization.json``, else that of the run
    ``policy.init`` named. A damaged record, or an older checkpoint whose sources are gone, is
    a one-line ConfigError (a resume must not go on without the normalisation it trained with)."""
    if NORM_KEY in manifest:
        return _manifest_normalization(manifest, checkpoint, what)
    f = run / NORM_FILE
    if f.is_file():
        return _normalization(f.read_text(), f, what)
    init = ((manifest.get("config") or {}).get("policy") or {}).get("init")
    norm = _init_normalization(init, run, what, 0)
    if norm is None and init and not resolve_run_arg(Path(init).expanduser()).exists():
        raise ConfigError(f"{what}: {checkpoint} records no normalisation (written before checkpoints carried it), "
                          f"and neither {run / NORM_FILE} nor policy.init's {init} is there to give it; copy the "
                          f"{NORM_FILE} of the run it started from into {run} (one holding {{}} if that run had none)")
    return norm


def read_weights(path: str | Path, what: str = "policy.init") -> StoredWeights:
    """The weights ``path`` names (see the module's docstring); ``what`` starts every error."""
    p = resolve_run_arg(Path(path).expanduser())
    if p.is_file() and (p.parent / MANIFEST_FILE).is_file():  # a checkpoint's tensors: its manifest's normalisation
        stored = _from_file(p, what)
        if stored.normalization is None:
            try:
                manifest = json.loads((p.parent / MANIFEST_FILE).read_text())
            except (OSError, ValueError):
                manifest = {}
            stored.normalization = _manifest_normalization(manifest if isinstance(manifest, dict) else {}, p.parent,
                                                           what)
        return _with_run_normalization(stored, p.parent.parent, what)
    if p.is_file():
        return _with_run_normalization(_from_file(p, what), p.parent, what)
    if not p.is_dir():
        raise ConfigError(f"{what}: {p} does not exist (give a run directory or a .safetensors file)")
    if (p / MANIFEST_FILE).is_file():  # one checkpoint's directory
        return _with_run_normalization(_from_checkpoint(CheckpointManager(p.parent), p, what), p.parent.parent, what)
    manager = CheckpointManager(p / "checkpoints")
    steps = manager.list()
    weights = p / WEIGHTS_FILE
    if not steps and not weights.is_file():
        raise ConfigError(f"{what}: {p} holds no weights (no {WEIGHTS_FILE}, no checkpoint in {p / 'checkpoints'})")
    if steps and (not weights.is_file() or int(steps[-1].name.split("-")[1]) > (_file_version(weights) or -1)):
        return _with_run_normalization(_from_checkpoint(manager, None, what), p, what)
    return _with_run_normalization(_from_file(weights, what), p, what)


def check_normalization(norm: Normalizer | None, policy: torch.nn.Module, where: str) -> None:
    """A ConfigError naming ``where`` when ``norm`` does not fit ``policy``'s proprio and
    action dimensions (nothing to check without either)."""
    spec = getattr(policy, "spec", None)
    if norm is not None and spec is not None:
        try:
            norm.check(spec.proprio_dim, spec.action_dim, where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def fit_policy(policy: torch.nn.Module, stored: StoredWeights, name: str, what: str = "policy.init") -> None:
    """Load ``stored`` into ``policy`` (registered as ``name``), strictly: a ConfigError when
    the recorded policy name differs, a shape differs, or a tensor is missing or unexpected."""
    if stored.policy is not None and stored.policy != name:
        raise ConfigError(f"{what}: {stored.path} holds weights of policy {stored.policy!r}, but policy.name is "
                          f"{name!r}")
    own = policy.state_dict()
    fit = f"{what}: {stored.path} does not fit policy {name!r} as policy.options build it"
    shapes = [f"{k} {tuple(stored.tensors[k].shape)} in the file, {tuple(t.shape)} here"
              for k, t in own.items() if k in stored.tensors and stored.tensors[k].shape != t.shape]
    if shapes:
        more = f" (and {len(shapes) - _SHOWN} more)" if len(shapes) > _SHOWN else ""
        raise ConfigError(f"{fit}: shapes differ: {'; '.join(shapes[:_SHOWN])}{more}")
    missing = [k for k in own if k not in stored.tensors]
    unexpected = [k for k in stored.tensors if k not in own]
    if missing or unexpected:
        parts = [f"{label} {', '.join(keys[:_SHOWN])}{f' (and {len(keys) - _SHOWN} more)' if len(keys) > _SHOWN else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ConfigError(f"{fit}: {'; '.join(parts)}")
    check_normalization(stored.normalization, policy, f"{what}: {stored.path}")
    policy.load_state_dict(stored.tensors)
    if stored.normalization is not None:
        policy.normalizer = stored.normalization


def load_init(policy: torch.nn.Module, path: str | Path, name: str) -> str:
    """``policy.init``: load the weights ``path`` names into ``policy``; the line to log."""
    stored = read_weights(path, "policy.init")
    fit_policy(policy, stored, name, "policy.init")
    return f"policy.init: loaded {stored.describe()}"
