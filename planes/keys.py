"""Persistent CurveZMQ client keys: one per rank, made once, kept in a directory.

With ``data_plane.curve`` every chunk is encrypted; with ``curve_authorized_dir`` a
learner's receiver also admits only clients whose public key is listed there. A key made
afresh by each sender could never be listed, so senders load theirs from
``curve_keys_dir``: ``dvla keys DIR --ranks N`` writes, for each rank,
``DIR/secret/rank{r}.key_secret`` (keep it on that rank's host, readable by its user only)
and ``DIR/public/rank{r}.key`` (copy the ones to admit into the authorised directory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import zmq
import zmq.auth

from planes.config import DataPlaneConfigError


def make_keys(directory: str | os.PathLike, names: list[str]) -> list[Path]:
    """Make a keypair per name under ``directory`` (``secret/`` and ``public/``); an
    existing key is kept, never overwritten. Returns the secret key files."""
    root = Path(directory)
    secret, public = root / "secret", root / "public"
    secret.mkdir(parents=True, exist_ok=True)
    public.mkdir(parents=True, exist_ok=True)
    os.chmod(secret, 0o700)
    out = []
    for name in names:
        path = secret / f"{name}.key_secret"
        if not path.exists():
            with tempfile.TemporaryDirectory(dir=secret) as tmp:
                pub_tmp, sec_tmp = zmq.auth.create_certificates(tmp, name)
                os.chmod(sec_tmp, 0o600)
                shutil.move(pub_tmp, public / f"{name}.key")
                os.replace(sec_tmp, path)
        out.append(path)
    return out


def load_client_keys(directory: str | os.PathLike, name: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` of ``name`` from a keys directory (its ``secret/`` part, or the
    directory itself); a missing or unreadable key is a one-line error."""
    root = Path(directory)
    for path in (root / "secret" / f"{name}.key_secret", root / f"{name}.key_secret"):
        if path.exists():
            try:
                public, secret = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                raise DataPlaneConfigError(f"data_plane.curve_keys_dir: cannot read {path}: {exc}") from None
            if not secret:
                raise DataPlaneConfigError(f"data_plane.curve_keys_dir: {path} holds no secret key")
            return public, secret
    raise DataPlaneConfigError(f"data_plane.curve_keys_dir: no key for {name} in {root} (expected "
                               f"{root / 'secret' / (name + '.key_secret')}); make them with "
                               f"`dvla keys {root} --ranks N`")
