import pytest

from dvla.config import ConfigError, JobConfig, apply_overrides, load_yaml, parse_override
from dvla.app.train import parse_config
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name):
    get_preset(name).validate()


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*debug"):
        get_preset("nope")


@pytest.mark.parametrize(
    "override, field",
    [
        ("env.n_envs=0", "env.n_envs"),
        ("algo.clip_eps=1.5", "algo.clip_eps"),
        ("algo.name=a2c", "algo.name"),
        ("run.device=tpu", "run.device"),
        ("env.n_envs=many", "env.n_envs"),
        ("algo.lr=-1", "algo.lr"),
        ("policy.temperature=0", "policy.temperature"),
        ("env.n_envs=10", "env.n_envs"),  # not a multiple of the GRPO group size (4)
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"{field}"):
        apply_overrides(get_preset("debug"), [override]).validate()


def test_error_lists_allowed_values():
    with pytest.raises(ConfigError, match="one of 'grpo', 'ppo'"):
        apply_overrides(get_preset("debug"), ["algo.name=a2c"]).validate()


def test_unknown_field_lists_allowed():
    with pytest.raises(ConfigError, match=r"env\.n_env: unknown field; allowed: .*n_envs"):
        apply_overrides(JobConfig(), ["env.n_env=3"])


def test_override_parsing_types():
    assert parse_override("--algo.lr=1e-3") == {"algo": {"lr": 1e-3}}
    assert parse_override("env.render=false") == {"env": {"render": False}}
    assert parse_override("env.options.gym_id=CartPole-v1") == {"env": {"options": {"gym_id": "CartPole-v1"}}}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("env.n_envs")


def test_overrides_merge_options():
    cfg = apply_overrides(get_preset("debug"), ["policy.options.hidden_dim=48"])
    assert cfg.policy.options["hidden_dim"] == 48
    assert cfg.policy.options["n_bins"] == 21  # the rest of the preset's options stay


def test_yaml_then_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  n_envs: 16\nalgo:\n  lr: 0.01\n")
    cfg = load_yaml(get_preset("debug"), path)
    assert cfg.env.n_envs == 16 and cfg.algo.lr == 0.01
    _, cfg = parse_config(["--preset", "debug", "--config", str(path), "algo.lr=0.002"])
    assert cfg.algo.lr == 0.002 and cfg.env.n_envs == 16


def test_yaml_unknown_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("enviroment:\n  n_envs: 16\n")
    with pytest.raises(ConfigError, match="enviroment: unknown field"):
        load_yaml(JobConfig(), path)


def test_policy_options_are_checked():
    spec = PolicySpec(image_shape=(3, 16, 16), proprio_dim=2, action_dim=2)
    with pytest.raises(ConfigError, match=r"policy\.options\.hiden_dim: unknown field"):
        build_policy("tiny_vla", spec, {"hiden_dim": 8})
    with pytest.raises(ConfigError, match=r"policy\.options\.n_bins: must be >= 2"):
        build_policy("tiny_vla", spec, {"n_bins": 1})
    with pytest.raises(ConfigError, match=r"policy\.options\.head: expected one of"):
        build_policy("tiny_vla", spec, {"head": "mixture"})
    with pytest.raises(ConfigError, match="unknown policy 'gpt'"):
        build_policy("gpt", spec)


def test_switching_a_component_drops_the_presets_options():
    from dvla.config.presets import fast_reach

    cfg = apply_overrides(fast_reach(), ["env.name=gym", "env.options.gym_id=Pendulum-v1"])
    assert cfg.env.options == {"gym_id": "Pendulum-v1"}  # fast_reach's 'privileged' is gone
    same = apply_overrides(fast_reach(), ["env.name=fast_reach", "env.options.radius=0.2"])
    assert same.env.options == {"privileged": True, "radius": 0.2}  # same env: options merge


def test_check_config_validates_components_without_building_them():
    from dvla.app.train import check_config

    check_config(get_preset("debug"))
    for override, match in [
        ("policy.options.hiden_dim=3", r"policy\.options\.hiden_dim: unknown field; allowed: .*hidden_dim"),
        ("policy.name=tiny", r"policy\.name: unknown policy 'tiny'; registered: .*tiny_vla"),
        ("env.options.privilegd=true", r"env\.options\.privilegd: unknown option .*allowed: .*privileged"),
        ("env.options.n_targets=9", r"env\.options\.n_targets: must be an integer in \[1, 4\]"),
        ("env.name=genesis_reech", r"env\.name: unknown env 'genesis_reech'; registered: .*genesis_reach"),
        ("env.name=gym", r"env\.options\.gym_id: required"),
        ("env.options.substeps_per_action=0", None),  # fast_reach has no such option
    ]:
        with pytest.raises(ConfigError, match=match or "substeps_per_action"):
            check_config(apply_overrides(get_preset("debug"), [override]))
    genesis = apply_overrides(get_preset("genesis_reach"), ["env.options.substeps_per_action=0"])
    with pytest.raises(ConfigError, match=r"env\.options\.substeps_per_action: must be an integer in \[1, 100\]"):
        check_config(genesis)  # genesis itself is not imported
    for override, match in [("env.options.vis_mode=wireframe", r"env\.options\.vis_mode: must be one of collision, visual, got 'wireframe'"),
                            ("env.options.action_mode=joint", r"env\.options\.action_mode: must be one of delta, target, got 'joint'"),
                            ("env.options.dt=-1", r"env\.options\.dt: must be a finite number in \(0, 0\.1\], got -1")]:
        with pytest.raises(ConfigError, match=match):
            check_config(apply_overrides(get_preset("genesis_reach"), [override]))
    gym = apply_overrides(get_preset("debug"), ["env.name=gym", "env.options.gym_id=NoSuchEnv-v3"])
    with pytest.raises(ConfigError, match=r"env\.options\.gym_id: .*NoSuchEnv"):
        check_config(gym)
    check_config(apply_overrides(get_preset("debug"), ["env.name=gym", "env.options.gym_id=Pendulum-v1",
                                                       "algo.name=ppo"]))


def test_run_fields():
    with pytest.raises(ConfigError, match=r"run\.iterations: must be >= 1, got 0"):
        apply_overrides(get_preset("debug"), ["run.iterations=0"]).validate()
    for bad in ("a/b", "latest", ".hidden"):
        with pytest.raises(ConfigError, match=r"run\.name: must be a plain directory name"):
            apply_overrides(get_preset("debug"), [f"run.name={bad}"]).validate()
    apply_overrides(get_preset("debug"), ["run.name=exp-1"]).validate()


def test_validation_errors_are_one_line():
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("debug"), ["env.n_envs=-3", "algo.lr=-1"]).validate()
    msg = str(info.value)
    assert "\n" not in msg and "env.n_envs: must be >= 1" in msg and "algo.lr: must be in (0, 1.0]" in msg


def test_yaml_errors_name_the_file_and_position(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such config file"):
        load_yaml(JobConfig(), tmp_path / "nope.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("env:\n  n_envs: 8\n  image_size: [16\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:4:1: invalid YAML: "):
        load_yaml(JobConfig(), path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: expected a mapping of config sections"):
        load_yaml(JobConfig(), path)


def test_command_line_mistakes_are_config_errors():
    with pytest.raises(ConfigError, match=r"unrecognised argument\(s\) --nope 5"):
        parse_config(["--preset", "debug", "--nope", "5"])
    with pytest.raises(ConfigError, match=r"--preset: expected one argument"):
        parse_config(["--preset"])


def test_listed_curve_keys_need_persistent_client_keys(tmp_path):
    from dvla.config.presets import debug

    (tmp_path / "pub").mkdir()
    with pytest.raises(ConfigError, match=r"data_plane.curve_authorized_dir: admits only listed client keys.*"
                                          r"set curve_keys_dir"):
        apply_overrides(debug(), ["data_plane.curve=true", f"data_plane.curve_authorized_dir={tmp_path / 'pub'}"])\
            .validate()
    with pytest.raises(ConfigError, match=r"data_plane.curve_authorized_dir: needs curve=true"):
        apply_overrides(debug(), [f"data_plane.curve_authorized_dir={tmp_path / 'pub'}",
                                  f"data_plane.curve_keys_dir={tmp_path}"]).validate()
    apply_overrides(debug(), ["data_plane.curve=true", f"data_plane.curve_authorized_dir={tmp_path / 'pub'}",
                              f"data_plane.curve_keys_dir={tmp_path}"]).validate()


# --------------------------------------------------------------------------------------
# One rule checks every numeric field: type, finiteness, declared range
# --------------------------------------------------------------------------------------

BOUND_KEYS = ("ge", "gt", "le", "lt")


def _numeric_leaves(cls=JobConfig, prefix=""):
    """``(dotted path, field, is_float)`` for every numeric leaf field under dataclass ``cls``:
    a field whose type is ``int`` or ``float`` (``None`` allowed beside it), found by walking
    the nested dataclasses, so that a new field is covered without listing it here."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_leaves(tp, f"{prefix}{f.name}.")
            continue
        members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        members = [m for m in members if m is not type(None)]
        if members and all(m in (int, float) for m in members):
            yield f"{prefix}{f.name}", f, float in members


def _with(cfg, path, value):
    """``cfg`` with the field at dotted ``path`` set to ``value`` (nothing validated)."""
    import dataclasses

    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _with(getattr(cfg, head), rest, value)})


def _outside(f, is_float):
    """Values just outside each declared bound of field ``f``."""
    step = 0.5 if is_float else 1
    out = []
    for key in BOUND_KEYS:
        if key in f.metadata:
            b = f.metadata[key]
            out.append({"ge": b - step, "gt": b, "le": b + step, "lt": b}[key])
    return out


NUMERIC = list(_numeric_leaves())


def test_the_walk_finds_the_numeric_fields_of_every_section():
    paths = {p for p, _, _ in NUMERIC}
    assert {"env.n_envs", "algo.lr", "run.seed", "swimlane.stall_timeout_s", "data_plane.send_timeout_s",
            "data_plane.send_hwm"} <= paths
    assert {p.split(".")[0] for p in paths} == {"env", "policy", "algo", "run", "swimlane", "data_plane"}
    assert not any(p.startswith("memory.") for p in paths)  # budgets: bytes, sizes or fractions (parse_budget)


@pytest.mark.parametrize("path, f, is_float", NUMERIC, ids=[p for p, _, _ in NUMERIC])
def test_every_numeric_field_declares_bounds(path, f, is_float):
    assert any(k in f.metadata for k in BOUND_KEYS), f"{path}: declare its range (ge/gt/le/lt) in the metadata"


@pytest.mark.parametrize("path, f, is_float", NUMERIC, ids=[p for p, _, _ in NUMERIC])
def test_every_numeric_field_rejects_non_finite_and_out_of_range_values(path, f, is_float):
    import re

    base = JobConfig()
    base.validate()
    bad = _outside(f, is_float)
    if is_float and not f.metadata.get("allow_inf"):
        bad += [float("nan"), float("inf"), float("-inf")]
    elif is_float:
        bad += [float("nan")]
    assert bad, path
    for value in bad:
        # the field, what it allows and the value given, on one line
        with pytest.raises(ConfigError, match=rf"^invalid configuration: {re.escape(path)}: must be [^;]+, "
                                              rf"got {re.escape(repr(value))}$"):
            _with(base, path, value).validate()


@pytest.mark.parametrize("override, message", [
    ("algo.lr=nan", r"algo\.lr: must be in \(0, 1\.0\], got nan"),
    ("algo.max_grad_norm=inf", r"algo\.max_grad_norm: must be > 0 and finite, got inf"),
    ("swimlane.stall_timeout_s=nan", r"swimlane\.stall_timeout_s: must be >= 0 and finite, got nan"),
    ("run.time_limit_s=inf", r"run\.time_limit_s: must be >= 0 and finite, got inf"),
    ("data_plane.send_timeout_s=-1", r"data_plane\.send_timeout_s: must be in \[0, .*\], got -1"),
    ("run.seed=1e23", r"run\.seed: expected int, got 1e\+23"),
    (f"run.seed={10**23}", r"run\.seed: must be in \[0, 2\*\*63\), got 100000000000000000000000"),
    ("run.seed=-1", r"run\.seed: must be in \[0, 2\*\*63\), got -1"),
    ("algo.gamma=nan", r"algo\.gamma: must be in \[0, 1\], got nan"),
    ("algo.adv_eps=0", r"algo\.adv_eps: must be > 0"),
])
def test_guards_that_nan_inf_or_a_huge_int_used_to_slip_past(override, message):
    with pytest.raises(ConfigError, match=rf"^invalid configuration: (.*; )?{message}"):
        apply_overrides(get_preset("debug"), [override]).validate()


def test_the_largest_seed_is_accepted():
    apply_overrides(get_preset("debug"), [f"run.seed={2**63 - 1}"]).validate()


def test_the_data_planes_own_check_reads_the_same_bounds():
    """A plane used on its own (TrajectorySender/Receiver call planes.config.check) reports
    what a job's validation reports for the same value."""
    import dataclasses

    from planes.config import DataPlaneConfig, DataPlaneConfigError, check

    with pytest.raises(DataPlaneConfigError, match=r"data_plane\.send_timeout_s: must be in \[0, .*\], got -1"):
        check(DataPlaneConfig(send_timeout_s=-1))
    with pytest.raises(DataPlaneConfigError, match=r"data_plane\.peer_timeout_s: must be > 0 and finite, got nan"):
        check(DataPlaneConfig(peer_timeout_s=float("nan")))
    check(DataPlaneConfig())
    fields = [(p.split(".", 1)[1], f, is_float) for p, f, is_float in NUMERIC if p.startswith("data_plane.")]
    assert len(fields) == 8
    for name, f, is_float in fields:
        for value in _outside(f, is_float) + ([float("nan"), float("inf")] if is_float else []):
            with pytest.raises(DataPlaneConfigError) as plane:
                check(DataPlaneConfig(**{name: value}))
            with pytest.raises(ConfigError) as job:
                dataclasses.replace(JobConfig(), data_plane=DataPlaneConfig(**{name: value})).validate()
            assert str(plane.value) == str(job.value), (name, value)


def test_memory_budgets_reject_non_finite_fractions():
    for value in ("nan", "inf", "-inf", "-1"):
        with pytest.raises(ConfigError, match=r"memory\.persistent_budget: invalid memory budget"):
            apply_overrides(get_preset("debug"), [f"memory.persistent_budget={value}"]).validate()


def test_cross_field_rules_run_once_every_field_is_in_range():
    # an out-of-range field is reported alone, not also by a rule that compares it with others
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("debug"), ["swimlane.spare_groups=-1"]).validate()
    assert str(info.value) == "invalid configuration: swimlane.spare_groups: must be >= 0, got -1"
    with pytest.raises(ConfigError, match=r"swimlane\.role_low: needs 0 < role_low < role_high < 1"):
        apply_overrides(get_preset("debug"), ["swimlane.role_low=0.6"]).validate()


def test_a_bounded_toy_section():
    import dataclasses

    from dvla.config import bounded, validate

    @dataclasses.dataclass(kw_only=True)
    class Toy:
        n: int = bounded(1, ge=1)
        frac: float = bounded(0.5, ge=0, le=1)
        scale: float = bounded(1.0, gt=0, allow_inf=True)
        free: float = 0.0

    validate(Toy(scale=float("inf")))
    for kwargs, message in [({"n": 0}, r"n: must be >= 1, got 0"),
                            ({"frac": 1.5}, r"frac: must be in \[0, 1\], got 1\.5"),
                            ({"scale": float("nan")}, r"scale: must be > 0, got nan"),
                            ({"free": float("-inf")}, r"free: must be finite, got -inf"),
                            ({"n": 1.0}, r"n: expected int, got 1\.0")]:
        with pytest.raises(ConfigError, match=rf"^invalid configuration: toy\.{message}$"):
            validate(Toy(**kwargs), "toy.")
    with pytest.raises(TypeError):
        bounded(1, gte=1)  # a misspelt bound is an error, not silently unchecked


def test_a_nan_on_the_command_line_is_one_line_and_exit_2(tmp_path, launcher):
    proc = launcher.run("dvla.launch", ["--preset", "debug", "algo.lr=nan", "--print-config"], cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("dvla: error: ") and "algo.lr: must be in (0, 1.0], got nan" in lines[0], lines[0]
    assert not proc.stdout.strip()  # no config printed
