"""Rank / local rank / device resolution across torchrun and SLURM variables."""
import pytest

from mhar_titan.launch_env import LaunchEnvError, device_index, resolve_launch_env


def test_single_process_without_launcher():
    e = resolve_launch_env({})
    assert (e.rank, e.local_rank, e.world_size, e.source) == (0, 0, 1, "single")


def test_torchrun_variables_win_over_slurm_task_variables():
    # torchrun inside an srun task: SLURM_PROCID numbers nodes, RANK numbers workers.
    env = {"RANK": "13", "LOCAL_RANK": "5", "WORLD_SIZE": "16", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
           "SLURM_NTASKS": "2"}
    e = resolve_launch_env(env)
    assert (e.rank, e.local_rank, e.world_size, e.source) == (13, 5, 16, "torchrun")


def test_srun_without_torchrun_uses_slurm_variables():
    e = resolve_launch_env({"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8"})
    assert (e.rank, e.local_rank, e.world_size, e.source) == (6, 2, 8, "slurm")


def test_local_rank_falls_back_to_slurm_localid():
    e = resolve_launch_env({"RANK": "3", "WORLD_SIZE": "4", "SLURM_LOCALID": "1"})
    assert e.local_rank == 1


@pytest.mark.parametrize("local_rank, visible, expected", [
    (5, 8, 5),   # all GPUs of the node visible to every worker
    (5, 1, 0),   # SLURM bound one GPU per task: it is always index 0
    (3, 2, 1),   # two GPUs per task
])
def test_device_index_is_local_rank_modulo_visible_devices(local_rank, visible, expected):
    assert device_index(local_rank, visible) == expected


def test_bad_variables_are_named():
    with pytest.raises(LaunchEnvError, match="LOCAL_RANK='x'"):
        resolve_launch_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"})
    with pytest.raises(LaunchEnvError, match="rank 4 is not below world size 4"):
        resolve_launch_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchEnvError, match="no accelerator is visible"):
        device_index(0, 0)
