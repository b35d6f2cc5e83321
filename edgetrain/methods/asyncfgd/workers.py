"""Parallel runtimes of AsyncFGD: K workers, one per module, working on one timestamp at a time.

Each `run` is one timestamp of Algorithm 1: every worker runs its module's forward on what the
previous timestamp left it (lines 2-6, all at once), the workers meet at a barrier where the last
one's directional derivatives are broadcast (line 7), then each updates its own module (lines 8-10).
With plain SGD the update is all or nothing: each worker first checks its module's update (nothing
written), the workers meet again, and only if no module refused does any of them write.
A worker touches only its own module's weights and buffers, so the result is bit-identical to the
`ReferenceScheduler` given the same intra-op thread count.

`ThreadWorkers` (CPU): one thread per module, each limited to `intra_op_threads` intra-op threads
(torch's thread count and MKL's are per calling thread) and pinned to its own core where the OS
allows (Linux sched_setaffinity on thread id 0 pins the calling thread). Torch kernels release the
GIL, so modules run in parallel as long as the kernels, not Python, take the time -- true for
convolutional modules at batch 4, not for a 64-32-10 MLP, where the pipeline only adds overhead.

`CudaStreamWorkers` (one GPU, e.g. a Jetson): the same threads, each issuing its module's kernels on
its own CUDA stream, so the GPU can overlap the modules. An activation crosses streams with an event
(the consumer waits for it) and record_stream (the allocator does not reuse its memory early).
"""
from __future__ import annotations

import os
import queue
import threading
import weakref
from contextlib import nullcontext
from typing import Any, Sequence

import torch

from edgetrain.methods.asyncfgd.schedule import (Finished, InFlight, TimestampOutcome, forward_stage,
                                                 update_stage)
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardStage
from edgetrain.registry import EdgetrainError


class _Timestamp:
    """One timestamp's work for all workers, and where they meet."""

    def __init__(self, inputs: Sequence[InFlight | None], learning_rates: dict[int, float] | None) -> None:
        count = len(inputs)
        self.inputs = list(inputs)
        self.learning_rates = learning_rates
        self.results: list[InFlight | Finished | None] = [None] * count
        self.errors: list[BaseException | None] = [None] * count
        self.refusals: list[NonFiniteError | None] = [None] * count
        self.broadcast = threading.Barrier(count)
        self.checked = threading.Barrier(count)


class ThreadWorkers:
    name = "threads"

    def __init__(self, stages: Sequence[ForwardStage], intra_op_threads: int = 1, pin: bool = True) -> None:
        if not isinstance(intra_op_threads, int) or intra_op_threads < 1:
            raise EdgetrainError(f"asyncfgd: intra_op_threads must be a positive integer, got {intra_op_threads!r}")
        self.stages = list(stages)
        self.intra_op_threads = intra_op_threads
        cores = sorted(os.sched_getaffinity(0)) if pin and hasattr(os, "sched_setaffinity") else []
        self.cores = [cores[k % len(cores)] for k in range(len(self.stages))] if cores else [None] * len(self.stages)
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.stages]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_serve, name=f"asyncfgd-worker-{k}", daemon=True,
                                          args=(self._worker_context(k), stage, self._jobs[k], self._done))
                         for k, stage in enumerate(self.stages)]
        for thread in self._threads:
            thread.start()
        # Stop the threads when the method is dropped, without the threads keeping it alive.
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._threads)

    def _worker_context(self, k: int) -> "_WorkerContext":
        return _WorkerContext(self.intra_op_threads, self.cores[k], None)

    def run(self, inputs: Sequence[InFlight | None], learning_rates: dict[int, float] | None) -> TimestampOutcome:
        job = _Timestamp(inputs, learning_rates)
        for jobs in self._jobs:
            jobs.put(job)
        for _ in self._jobs:
            self._done.get()
        self._after_timestamp()
        for error in job.errors:  # the lowest module's error first: it is the cause of the rest
            if error is not None:
                raise error
        finished = job.results[-1]
        refused = next((r for r in job.refusals if r is not None), None)
        return TimestampOutcome(list(job.results[:-1]), finished, refused)  # type: ignore[arg-type]

    def _after_timestamp(self) -> None:
        pass

    def close(self) -> None:
        self._finalizer()


class _WorkerContext:
    def __init__(self, intra_op_threads: int, core: int | None, stream: Any) -> None:
        self.intra_op_threads = intra_op_threads
        self.core = core
        self.stream = stream

    def enter(self) -> None:
        torch.set_num_threads(self.intra_op_threads)
        if self.core is not None:
            try:
                os.sched_setaffinity(0, {self.core})
            except OSError:  # a container may forbid it; the worker still runs, unpinned
                pass


def _serve(context: _WorkerContext, stage: ForwardStage, jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    context.enter()
    k = stage.index
    while True:
        job = jobs.get()
        if job is None:
            return
        stream_scope = torch.cuda.stream(context.stream) if context.stream is not None else nullcontext()
        with stream_scope:
            try:
                incoming = job.inputs[k]
                if context.stream is not None:
                    _arrive_on(context.stream, incoming)
                result = forward_stage(stage, incoming)
                if context.stream is not None and isinstance(result, InFlight):
                    result.ready = torch.cuda.Event()
                    result.ready.record(context.stream)
                job.results[k] = result
            except BaseException as error:  # reported by the coordinator after the barrier
                job.errors[k] = error
            try:
                job.broadcast.wait()  # line 7: the last module's derivatives are now in job.results[-1]
                finished = job.results[-1]
                ready = finished is not None and finished.finite and not any(e is not None for e in job.errors)
                if ready and job.learning_rates is not None:
                    try:
                        stage.check_update(finished.sample, finished.derivatives, job.learning_rates)
                    except NonFiniteError as refusal:
                        job.refusals[k] = refusal
                    except BaseException as error:
                        job.errors[k] = error
                job.checked.wait()  # every module has checked its update; none has written
                if ready and not any(r is not None for r in job.refusals) \
                        and not any(e is not None for e in job.errors):
                    update_stage(stage, finished, job.learning_rates)
            except BaseException as error:
                job.errors[k] = job.errors[k] or error
        done.put(k)


def _arrive_on(stream: Any, incoming: InFlight | None) -> None:
    """Make `stream` wait until the producer of `incoming` has written it, and tell the allocator."""
    if incoming is None:
        return
    if incoming.ready is not None:
        stream.wait_event(incoming.ready)
    else:  # module 0's input comes from the default stream (the learner's batch.to(device))
        stream.wait_stream(torch.cuda.default_stream(stream.device))
    for tensor in [incoming.activation, incoming.targets, *incoming.jvps]:
        if tensor is not None and tensor.is_cuda:
            tensor.record_stream(stream)


def _stop(jobs: list[queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for queue_ in jobs:
        queue_.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=5)


class CudaStreamWorkers(ThreadWorkers):
    name = "cuda-streams"

    def __init__(self, stages: Sequence[ForwardStage], device: torch.device, intra_op_threads: int = 1) -> None:
        if not torch.cuda.is_available():
            raise EdgetrainError("asyncfgd: runtime 'cuda-streams' needs CUDA; use 'threads' on a CPU")
        self.device = torch.device(device)
        self.streams = [torch.cuda.Stream(device=self.device) for _ in stages]
        super().__init__(stages, intra_op_threads=intra_op_threads, pin=False)

    def _worker_context(self, k: int) -> _WorkerContext:
        return _WorkerContext(self.intra_op_threads, None, self.streams[k])

    def run(self, inputs: Sequence[InFlight | None], learning_rates: dict[int, float] | None) -> TimestampOutcome:
        # Weights may have been changed on the default stream (a general optimizer's step, a checkpoint
        # load); every module stream starts the timestamp after that.
        default = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(default)
        return super().run(inputs, learning_rates)

    def _after_timestamp(self) -> None:
        # The coordinator's next work (optimizer.step on .grad, the learner's synchronize) follows the
        # modules' updates.
        default = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            default.wait_stream(stream)
