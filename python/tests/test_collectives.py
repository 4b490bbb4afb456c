"""Multi-rank tests of the TorchComms-style API over the cpu backend."""

import pytest


@pytest.mark.parametrize("dtype", ["float32", "int32", "int8"])
def test_collective_grid_counts_0_4_1024_1mi_every_op_sync_and_async(ranks, dtype):
    ranks(3, "grid", dtype).assert_ok("grid")


def test_buffers_unaligned_readonly_strided_and_2d(ranks):
    ranks(2, "buffers").assert_ok("buffers")


def test_dlpack_only_arrays_in_place_across_ranks(ranks):
    ranks(2, "dlpack").assert_ok("dlpack")


def test_mismatched_counts_raise_mismatch_error_on_every_rank(ranks):
    ranks(3, "mismatch").assert_ok("mismatch")


def test_fingerprint_mismatch_aborts_every_rank(ranks):
    ranks(3, "fingerprint_mismatch").assert_ok("fingerprint_mismatch")


def test_split_gives_members_a_subcommunicator_and_others_none(ranks):
    ranks(4, "split").assert_ok("split")


def test_abort_fails_ops_here_and_on_the_peer(ranks):
    ranks(2, "abort").assert_ok("abort")


def test_killed_rank_is_peer_failed_then_survivors_reconfigure(ranks):
    res = ranks(3, "killed")
    res.assert_ok("killed", ranks=[0, 1])
    assert res.procs[2][0] == -9, res.procs[2]


def test_a_new_process_joins_the_survivors_epoch(ranks):
    res = ranks(3, "rejoin", joiners=1)
    res.assert_ok("rejoin", ranks=[0, 1, 3])
    assert res.procs[2][0] == -9, res.procs[2]


def test_op_timeout_raises_chorus_and_builtin_timeout_error(ranks):
    ranks(2, "timeout").assert_ok("timeout")


def test_ctrl_c_interrupts_a_blocked_wait(ranks):
    ranks(2, "interrupt").assert_ok("interrupt")


def test_a_blocked_op_releases_the_gil(ranks):
    ranks(2, "gil").assert_ok("gil")


def test_torch_cpu_tensors_in_place(ranks):
    pytest.importorskip("torch")
    ranks(2, "torch").assert_ok("torch")


def test_hooks_and_flight_recorder_see_every_op_with_its_hints_and_outcome(ranks):
    ranks(2, "hooks").assert_ok("hooks")


def test_hooks_have_run_when_an_op_returns(ranks):
    ranks(2, "hooks_before_return").assert_ok("hooks_before_return")


def test_flight_recorder_hook_traces_of_every_rank_read_as_one_job(ranks):
    ranks(4, "flight_recorder").assert_ok("flight_recorder")


def test_flight_recorder_hook_writes_its_trace_when_the_communicator_aborts(ranks, tmp_path):
    ranks(4, "flight_recorder_abort", str(tmp_path)).assert_ok("flight_recorder_abort")


def test_persistent_all_gather_reuses_its_output_and_checks_agreement(ranks):
    ranks(3, "persistent").assert_ok("persistent")


def test_window_put_signal_wait_signal_ring(ranks):
    ranks(3, "window").assert_ok("window")


def test_object_collectives_of_torchcomms_objcol(ranks):
    ranks(3, "objcol").assert_ok("objcol")


def test_all_to_all_v_single_counts_rows_of_dimension_0(ranks):
    ranks(3, "a2av_rows").assert_ok("a2av_rows")


def test_tensor_register_init_handle_and_uuid_reconfigure_as_torchcomms(ranks):
    ranks(2, "torchcomms_surface").assert_ok("torchcomms_surface")


def test_new_comm_through_a_torch_store_needs_no_secret(ranks):
    ranks(3, "torch_store").assert_ok("torch_store")


def test_bad_split_lists_raise_runtime_error_on_every_rank(ranks):
    ranks(3, "split_errors").assert_ok("split_errors")
