"""``dvla keys``: persistent CurveZMQ client keys, one per rank (:mod:`planes.keys`)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    import argparse

    from planes.keys import make_keys

    ap = argparse.ArgumentParser(prog="dvla keys", description=(
        "Make a CurveZMQ keypair per rank: DIR/secret/rank{r}.key_secret (data_plane.curve_keys_dir=DIR on "
        "that rank's host) and DIR/public/rank{r}.key (copy those to admit into data_plane.curve_authorized_dir). "
        "Existing keys are kept."))
    ap.add_argument("directory")
    ap.add_argument("--ranks", type=int, required=True, help="world size: keys rank0 .. rank{N-1}")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be >= 1, got {args.ranks}")
    made = make_keys(args.directory, [f"rank{r}" for r in range(args.ranks)])
    print(f"{len(made)} keys in {args.directory}/secret (secret) and {args.directory}/public (public); run with "
          f"data_plane.curve=true data_plane.curve_keys_dir={args.directory} "
          f"data_plane.curve_authorized_dir={args.directory}/public")
    return 0
