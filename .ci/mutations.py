"""Mutation check: each core behaviour, disabled in a throwaway copy, makes a test fail.

    python .ci/mutations.py            # every mutation (CI runs this)
    python .ci/mutations.py NAME ...   # some of them; --list names them

A test that passes whatever the code does is a defect (issue 36).  For each
mutation below, the package and its tests are copied to a temporary directory,
one exact piece of text in one module is replaced (the behaviour is switched
off), and a few targeted tests run against the copy.  The mutation must make
them fail: with ``each``, every listed test must fail, else at least one.  A
control run of every listed test against the unmutated copy comes first and
must pass, so a failure is the mutation's doing.  If a mutation's text is no
longer in its module, the check fails and says so: update the mutation with
the code.

Every pytest here starts with SIGINT ignored, as a job started with ``&`` from
a script does: the Ctrl-C tests must make sure of their own premise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("torchfeed", "tests", "setup.cfg", "conftest.py", "pyproject.toml", "pytest.ini")
RUN_LIMIT_S = 300  # one pytest run; the tests' own timeouts are far shorter

EPOCH_BOUNDARY = "tests/test_resume_epoch_boundary.py"
OLD_CHECKPOINTS = "tests/test_resume_old_checkpoints.py"
MAIN_DEATH = "tests/faults/test_faults_main_death.py"
SHARE_EXACT = "tests/test_share_exact.py"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    why: str      # the behaviour switched off
    module: str   # relative to the repository root
    old: str      # must occur exactly once in the module
    new: str
    tests: tuple[str, ...]
    each: bool = False  # every listed test must fail, not just one


MUTATIONS = (
    Mutation(
        "load-state-noop", "resume: load_state_dict reads the state and applies nothing",
        "torchfeed/_state.py",
        "    checkpoint = Checkpoint.read(state)  # the one reading of the dict\n",
        "    Checkpoint.read(state)\n    return\n",
        (f"{EPOCH_BOUNDARY}::test_two_epochs_then_two_more_equal_four_epochs",
         "tests/test_resume.py::test_batch_sampler_resumes_exactly"),
        each=True),
    Mutation(
        "epoch-end-rng-ignored", "resume: a state at an epoch's end puts no global RNG back",
        "torchfeed/_state.py",
        "                     global_rng=cp.next_epoch_global_rng,\n",
        "                     global_rng=None,\n",
        (EPOCH_BOUNDARY,)),
    Mutation(
        "optional-field-required", "old checkpoints: a field added within version 1 is required",
        "torchfeed/_checkpoint.py",
        "        fields = {**{f: None for f in _OPTIONAL}, **state}\n",
        "        fields = dict(state)\n",
        (f"{OLD_CHECKPOINTS}::test_a_checkpoint_without_a_later_field_resumes_exactly",)),
    Mutation(
        "checkpoint-aliases", "checkpoint: the loaded value shares the caller's nested dicts",
        "torchfeed/_checkpoint.py",
        "        return cls(**_owned(values))\n",
        "        return cls(**values)\n",
        (f"{OLD_CHECKPOINTS}::test_a_loaded_state_shares_nothing_with_its_dicts",)),
    Mutation(
        "checkpoint-gives-itself-away",
        "checkpoint: the dict state_dict() gives back shares the loaded value's",
        "torchfeed/_checkpoint.py",
        "        return copy.deepcopy(out)  # the caller's to change\n",
        "        return out\n",
        (f"{OLD_CHECKPOINTS}::test_a_loaded_state_shares_nothing_with_its_dicts",)),
    Mutation(
        "out-of-order", "ordering: batches are yielded as they arrive, whatever in_order says",
        "torchfeed/_worker_iterator.py",
        "            if send_idx != self._rcvd_idx:\n                if not self._in_order:\n",
        "            if send_idx != self._rcvd_idx:\n                if True:\n",
        ("tests/test_parity.py::test_in_order_slow_sample_keeps_order",)),
    Mutation(
        "worker-error-words", "error sentences: torch's sentence for a worker's exception",
        "torchfeed/_errors.py",
        'head = f"Caught {self.exc_name} in DataLoader worker {self.kind} {self.worker_id}."',
        'head = f"Caught {self.exc_name} in worker {self.worker_id}."',
        ("tests/test_torch_errors.py::test_exception_in_a_worker_is_caught_in_torchs_words",)),
    Mutation(
        "dead-worker-words", "error sentences: torch's sentence for a dead worker",
        "torchfeed/_errors.py",
        'lines = [f"DataLoader worker (pid(s) {pids}) exited unexpectedly"]',
        'lines = [f"DataLoader worker(s) {pids} died"]',
        ("tests/test_torch_errors.py::test_every_dead_worker_is_in_torchs_pid_list",)),
    Mutation(
        "workers-take-ctrl-c", "shutdown: workers do not ignore Ctrl-C",
        "torchfeed/_worker.py",
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n",
        "",
        (f"{MAIN_DEATH}::test_ctrl_c_exits_cleanly[map-fresh]",)),
    Mutation(
        "ctrl-c-dropped-in-release",
        "shutdown: a Ctrl-C landing in a batch's release is dropped, and the slot with it",
        "torchfeed/_transport/_unpacker.py",
        "                if states[idx] == IN_FLIGHT:\n"
        "                    states[idx] = FREE  # its pages as they are: a worker's write fills a hole\n"
        "                if not isinstance(exc, KeyboardInterrupt):\n"
        "                    raise\n"
        "                _dropped_ctrl_c.keep()\n",
        "                raise\n",
        ("tests/test_shutdown.py::"
         "test_ctrl_c_while_a_batch_is_released_is_raised_and_its_slot_goes_back",)),
    Mutation(
        "ctrl-c-cut-at-release-entry",
        "shutdown: a Ctrl-C landing on a release's first instruction drops the release "
        "and the Ctrl-C with it",
        "torchfeed/_dropped_ctrl_c.py",
        "_WATCHABLE = _newest_callback_first()\n",
        "_WATCHABLE = False\n",
        ("tests/test_shutdown.py::"
         "test_ctrl_c_on_the_first_instruction_of_a_release_is_raised_and_its_slot_goes_back",)),
    Mutation(
        "no-shutdown", "shutdown: an iterator never stops its workers",
        "torchfeed/_multiprocess.py",
        "        if self.shut_down:\n            return\n",
        "        return\n",
        ("tests/test_shutdown.py::test_deleting_a_persistent_loader_needs_no_garbage_collector",)),
    Mutation(
        "temp-folder-left", "shutdown: multiprocessing's folder of a killed worker or a "
        "SIGKILLed main process is left in /tmp",
        "torchfeed/_worker_tempdir.py",
        "    if folder is not None:\n        shutil.rmtree(folder, ignore_errors=True)\n",
        "    return\n",
        ("tests/faults/test_faults_dead_holder.py::test_worker_dies_holding[fresh]",
         "tests/test_transport_loader.py::test_nothing_left_after_main_process_sigkill"),
        each=True),
    Mutation(
        "slot-reused-while-held",
        "integrity: a worker writes into a slot whose batch the main process holds",
        "torchfeed/_transport/_slots.py",
        "(state == FREE or state == FILLING or state == COLD)",
        "(state != PUNCHED)",
        ("tests/test_transport.py::test_slot_stays_in_use_while_any_view_of_the_batch_lives",)),
    Mutation(
        "worker-seed-not-torchs", "seeding: every worker gets the same seed, not torch's "
        "base_seed + worker_id",
        "torchfeed/_seeding.py",
        "    seed = base_seed + worker_id\n    random.seed(seed)\n",
        "    seed = base_seed\n    random.seed(seed)\n",
        ("tests/test_seeding.py::test_worker_seeds_are_base_seed_plus_id",)),
    Mutation(
        "rank-split-not-torchs", "distributed: each rank takes a contiguous block of the "
        "epoch, not torch's every num_replicas-th index",
        "torchfeed/distributed.py",
        "        return indices[self.rank :: self.num_replicas].clone()\n",
        "        share = len(indices) // self.num_replicas\n"
        "        return indices[self.rank * share : (self.rank + 1) * share].clone()\n",
        ("tests/test_distributed.py::test_same_indices_and_len_as_torch",)),
    Mutation(
        "unfenced-slot-freed", "integrity: a page-locked slot goes back to its worker "
        "though no CUDA fence proved the copy from it done",
        "torchfeed/_transport/_releaser.py",
        "                return self._unfenced(jobs, fence_error, sync_error)\n",
        "                pass\n",
        ("tests/test_device_stage.py::test_a_fence_that_cannot_be_proven_never_frees_a_slot",
         "tests/test_device_stage.py::"
         "test_a_fence_that_fails_for_a_while_frees_the_slot_only_once_it_passes"),
        each=True),
    Mutation(
        "share-dataset-noop", "sharing: share_dataset=True leaves the dataset's large "
        "attributes as they are, copied into every worker",
        "torchfeed/_share_job.py",
        "    found = find_large(dataset)\n",
        "    found = []\n",
        ("tests/test_share_dataset.py::"
         "test_coco_like_attributes_are_shared_and_batches_equal_torchs[fork]",
         "tests/test_share_dataset.py::test_workers_reading_every_record_hold_no_copy_of_them[fork]"),
        each=True),
    Mutation(
        "share-sends-values", "sharing: a shared container goes to another process as its "
        "values, not as a handle to the one copy",
        "torchfeed/_share/_sequence.py",
        "        return SharedSequence._attach, (self._buffer, self._part)\n",
        "        return self.__reduce_ex__(4)\n",
        ("tests/test_share.py::test_a_handle_crosses_processes_and_pickle_writes_values",)),
    Mutation(
        "shared-array-read-only", "sharing: a shared array is mapped read-only, and an "
        "in-place write to a sample (torch.from_numpy(row).sub_()) kills the process",
        "torchfeed/_share/_buffer.py",
        "    if private and lib.mprotect(addr, length, mmap.PROT_READ | mmap.PROT_WRITE) != 0:\n",
        "    if False:\n",
        (f"{SHARE_EXACT}::test_an_in_place_write_to_a_shared_array_is_private_and_never_crashes",)),
    Mutation(
        "share-aliases-missed", "sharing: an attribute that is another's very object "
        "(ImageFolder.imgs, its samples) is left a Python list beside the shared one",
        "torchfeed/_share_dataset.py",
        "                found.append(Found(where, obj, name, value, earlier.nbytes, earlier.why_not,\n"
        "                                   earlier.path))\n",
        "                pass\n",
        ("tests/test_share_shapes.py::"
         "test_image_folder_aliases_are_one_shared_object_and_spawn_sends_a_handle",)),
    Mutation(
        "share-stores-per-record", "sharing: an object many records hold is stored once per "
        "record (a COCO index three times over)",
        "torchfeed/_share/_dedup.py",
        "    shared = ids[counts > 1]\n",
        "    shared = ids[:0]\n",
        (f"{SHARE_EXACT}::test_an_object_many_records_hold_is_stored_once",
         f"{SHARE_EXACT}::test_a_coco_index_reachable_three_ways_is_stored_about_once"),
        each=True),
    Mutation(
        "share-seals-unchecked", "sharing: memory that is not sealed is mapped, and later "
        "writes to it show through",
        "torchfeed/_share/_buffer.py",
        "    missing = seals(final=False) & ~present\n",
        "    missing = 0\n",
        (f"{SHARE_EXACT}::test_unsealed_memory_is_refused",)),
    Mutation(
        "share-at-first-iter", "sharing: share_dataset=True shares at the first iter(), whose "
        "first batch then pays for the pass over the data",
        "torchfeed/_share_job.py",
        "    job = _jobs[loader] = SharingJob(loader.dataset, method)\n    job.start()\n",
        "    return\n",
        ("tests/test_share_dataset.py::test_sharing_starts_at_construction_and_a_fork_waits_for_it",)),
    Mutation(
        "shared-record-misread", "integrity: a shared list hands out its next record",
        "torchfeed/_share/_sequence.py",
        "        data = self._view[offsets[i]:offsets[i + 1]]\n",
        "        i = min(i + 1, self._len - 1)\n"
        "        data = self._view[offsets[i]:offsets[i + 1]]\n",
        ("tests/test_share.py::test_list_behaves_as_the_list",
         "tests/test_share_dataset.py::test_resume_with_shared_attributes_equals_torchs_epoch"),
        each=True),
    Mutation(
        "sentinel-only", "never hang: a dead worker is seen by its sentinel alone, never is_alive()",
        "torchfeed/_receive.py",
        "            ready = [s for s, worker_id in sentinels.items() if not self._alive(worker_id)]\n",
        "            ready = []\n",
        ("tests/faults/test_faults_worker_death.py::"
         "test_dead_worker_whose_sentinel_stays_quiet_is_seen",)),
    Mutation(
        "half-message-sentinel-only",
        "never hang: a writer that died mid-message is seen by its sentinel alone",
        "torchfeed/_ipc/_pipe_reader.py",
        "                if not woken and alive is not None:\n",
        "                if False:\n",
        ("tests/faults/test_faults_half_message.py::"
         "test_worker_killed_mid_write_never_hangs[spawn-quiet-sentinel]",)),
    Mutation(
        "host-name-at-import", "platforms: a name Windows lacks (signal.SIGBUS) is used while "
        "torchfeed is imported",
        "torchfeed/_errors.py",
        '_SIGBUS = getattr(signal, "SIGBUS", None)\n',
        "_SIGBUS = signal.SIGBUS\n",
        ("tests/test_host_names.py::test_no_host_only_name_used_at_import",)),
    Mutation(
        "shm-default-without-slots", "platforms: the default transport is 'shm' where the "
        "slots cannot exist, so loader.transport and stats() name what does not run",
        "torchfeed/_options.py",
        "        if _host.SHM_SLOTS:\n            return \"shm\"\n",
        "        return \"shm\"\n",
        ("tests/test_platforms.py::test_without_slots_the_transport_is_torchs_and_says_so",)),
    Mutation(
        "relay-leftover-token", "portable backend: the relay's pipe stays readable after its "
        "messages are taken, so a wait wakes for nothing and outlives its timeout",
        "torchfeed/_ipc/_relay.py",
        "                    if len(inbox) == 1:\n                        wake.send_bytes(_TOKEN)",
        "                    wake.send_bytes(_TOKEN)",
        ("tests/test_platforms.py::test_relay_is_readable_exactly_while_a_message_waits",)),
    Mutation(
        "watchdog-os-kill-anywhere", "portable backend: the workers' watchdog checks the main "
        "process with os.kill(pid, 0), a Ctrl-C on Windows",
        "torchfeed/_worker.py",
        "    if not _host.HAS_POSIX_SIGNALS or not _host.fd_backend():\n"
        "        return _watched(main_pid).is_running()\n",
        "",
        ("tests/test_platforms.py::test_portable_watchdog_watches_the_main_process_without_signals",)),
    Mutation(
        "thread-generators-shared",
        "thread workers: every thread's generators seeded with base_seed, not base_seed + id",
        "torchfeed/_seeding.py",
        "    seed = base_seed + worker_id\n    torch_generator = torch.Generator()\n",
        "    seed = base_seed\n    torch_generator = torch.Generator()\n",
        ("tests/test_thread_workers.py::"
         "test_worker_info_is_per_thread_with_its_own_generators_seeded_from_base_seed_plus_id",)),
    Mutation(
        "thread-shutdown-waits", "shutdown: the thread iterator joins a stuck thread without a deadline",
        "torchfeed/_thread_iterator.py",
        "                    thread.join(max(0.0, deadline - time.monotonic()))\n",
        "                    thread.join()\n",
        ("tests/test_thread_workers.py::test_a_thread_stuck_in_getitem_does_not_hold_up_the_shutdown",)),
    Mutation(
        "thread-batch-reused-while-held",
        "integrity: a thread worker writes its next batch into the memory of one the user holds",
        "torchfeed/_thread_collate.py",
        "        weakref.finalize(view, self._given_back.put, (nbytes, buffer)).atexit = False\n",
        "        self._given_back.put((nbytes, buffer))\n",
        ("tests/test_thread_workers.py::test_a_batchs_memory_is_used_again_only_once_nothing_refers_to_it",
         "tests/test_thread_workers.py::test_recycled_batches_equal_torchs_whatever_the_consumer_keeps"),
        each=True),
    Mutation(
        "thread-stream-off",
        "thread workers: a batch's samples are all held until the stack reads them back, cold",
        "torchfeed/_thread_collate.py",
        "    takes_sample_stream = True  # the fetcher may pass a SampleStream",
        "    takes_sample_stream = False  # the fetcher may pass a SampleStream",
        ("tests/test_stream.py::test_streamed_batches_equal_torchs_and_each_sample_is_freed_before_the_next[numpy-thread]",)),
    Mutation(
        "thread-death-unseen", "thread workers: a thread that ended by itself is waited for",
        "torchfeed/_thread_iterator.py",
        "        except queue.Empty:\n            self._check_threads()\n",
        "        except queue.Empty:\n",
        ("tests/test_thread_workers.py::test_a_thread_that_ends_by_itself_is_reported_not_waited_for",)),
)


# Tests whose premise the environment can remove, run in the control only: they must
# pass in a pytest started with SIGINT ignored (each restores what it needs).
PREMISES = ("tests/test_shutdown.py::test_keyboard_interrupt_in_main_process",)


def _copy(dest: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, dest)


def _apply(dest: str, m: Mutation) -> None:
    path = os.path.join(dest, m.module)
    with open(path) as f:
        text = f.read()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutation {m.name}: its text occurs {count} times in {m.module}, "
                         f"not once; update the mutation with the code:\n{m.old}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def _pytest(cwd: str, tests, stop_at_first: bool) -> tuple[int, str, float]:
    """pytest on ``tests`` in ``cwd`` (its copy of torchfeed comes first on sys.path),
    started with SIGINT ignored; (exit code, output, seconds)."""
    start = "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.SIG_IGN); " \
            "sys.exit(pytest.main(sys.argv[1:]))"
    args = [sys.executable, "-c", start, "-q", "-rfE", "-p", "no:cacheprovider",
            "-o", "addopts=", *(["-x"] if stop_at_first else []), *tests]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    began = time.monotonic()
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=RUN_LIMIT_S, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        return -1, out + f"\n(pytest ran past {RUN_LIMIT_S} s)", time.monotonic() - began
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def _failed_ids(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def _check(m: Mutation, workdir: str) -> tuple[bool, str]:
    dest = os.path.join(workdir, m.name)
    os.makedirs(dest)
    _copy(dest)
    _apply(dest, m)
    code, output, took = _pytest(dest, m.tests, stop_at_first=not m.each)
    failed = _failed_ids(output)
    if code == 1 and m.each:
        missed = [t for t in m.tests if not any(f.startswith(t) for f in failed)]
        ok = not missed
        verdict = "every listed test failed" if ok else f"these passed: {missed}"
    elif code == 1:
        ok, verdict = True, f"{failed[0] if failed else 'a test'} failed"
    elif code == 0:
        ok, verdict = False, "every test passed: nothing guards this behaviour"
    else:
        ok, verdict = False, f"pytest exited {code} (not a test failure)"
    tail = "" if ok else "\n" + "\n".join(output.splitlines()[-25:])
    return ok, f"{'ok  ' if ok else 'FAIL'} {m.name} ({took:.0f} s): {m.why}: {verdict}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name the mutations and stop")
    args = parser.parse_args()
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.why}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no mutation named {', '.join(sorted(unknown))}; see --list")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    workdir = tempfile.mkdtemp(prefix="torchfeed-mutations-")
    try:
        control = os.path.join(workdir, "control")
        os.makedirs(control)
        _copy(control)
        tests = list(dict.fromkeys([*PREMISES, *(t for m in chosen for t in m.tests)]))
        code, output, took = _pytest(control, tests, stop_at_first=False)
        if code != 0:
            print(output)
            print(f"FAIL control: the targeted tests do not pass unmutated (exit {code})")
            return 1
        print(f"ok   control ({took:.0f} s): {len(tests)} targeted test ids pass unmutated")
        # Two at a time: most of a run is waiting on worker processes.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda m: _check(m, workdir), chosen))
        for ok, line in results:
            print(line)
        bad = sum(not ok for ok, _ in results)
        print(f"{len(results) - bad} of {len(results)} mutations caught")
        return 1 if bad else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
