import pytest

from dvla.config import ConfigError, JobConfig, apply_overrides, load_yaml, parse_override
from dvla.launch import parse_config
from dvla.policy import PolicySpec, build_policy
from dvla.presets import PRESETS, get_preset


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
    from dvla.presets import fast_reach

    cfg = apply_overrides(fast_reach(), ["env.name=gym", "env.options.gym_id=Pendulum-v1"])
    assert cfg.env.options == {"gym_id": "Pendulum-v1"}  # fast_reach's 'privileged' is gone
    same = apply_overrides(fast_reach(), ["env.name=fast_reach", "env.options.radius=0.2"])
    assert same.env.options == {"privileged": True, "radius": 0.2}  # same env: options merge


def test_check_config_validates_components_without_building_them():
    from dvla.launch import check_config

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
    with pytest.raises(ConfigError, match=r"env\.options\.substeps_per_action: must be an integer >= 1"):
        check_config(genesis)  # genesis itself is not imported
    for override, match in [("env.options.vis_mode=wireframe", r"env\.options\.vis_mode: must be one of collision, visual, got 'wireframe'"),
                            ("env.options.action_mode=joint", r"env\.options\.action_mode: must be one of delta, target, got 'joint'"),
                            ("env.options.dt=-1", r"env\.options\.dt: must be a number > 0, got -1")]:
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
    assert "\n" not in msg and "env.n_envs: must be >= 1" in msg and "algo.lr: must be > 0" in msg


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
    from dvla.presets import debug

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
