"""The lifetime of a run's threads and queues: the stop flag (Stop) and the queue waits that see it (queue_get,
queue_put), errors in threads that stop the run (stops_run_on_error), signals, the stall watchdog, and the end: threads
joined, a checkpoint on a signal, the processes' shut-down (shut_down), the logs closed and the exit status.
"""

import faulthandler
import os
import queue
import signal
import sys
import threading
import time
from traceback import print_exception

import jax

from cleanba.checkpoint import checkpoint_path


class StopTraining(Exception):
    """Raised in a thread that waits on a queue after the run was told to stop."""


class Stop(threading.Event):
    """Set when the run must stop: at the end, on a signal (SIGINT, SIGTERM) or on an error in any thread. Every
    queue wait sees it within 0.2 s (StopTraining), the learner at each iteration. It keeps why."""

    def __init__(self):
        super().__init__()
        self.signals, self.errors = [], []


def queue_get(q: queue.Queue, stop: Stop):
    while True:  # short timeouts so a stop (error elsewhere, Ctrl-C, end of run) is seen promptly
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                raise StopTraining from None


def queue_put(q: queue.Queue, item, stop: Stop):
    while True:
        try:
            return q.put(item, timeout=0.2)
        except queue.Full:
            if stop.is_set():
                raise StopTraining from None


def stops_run_on_error(body):
    """A thread's body whose last argument is the run's Stop: an error in it stops the whole run, and the main thread
    reports it (exit_status); StopTraining just ends the thread."""

    def thread(*thread_args):
        try:
            body(*thread_args)
        except StopTraining:
            pass
        except BaseException as error:
            thread_args[-1].errors.append(error)
            thread_args[-1].set()

    return thread


def handle_signals(stop: Stop, distributed: bool):
    """SIGINT and SIGTERM stop the run at the next queue wait or iteration boundary; it then checkpoints and exits."""

    def on_signal(signum, frame):
        stop.signals.append(signum)
        if distributed:  # processes must stop after the same iteration, or one would wait forever in a
            os.kill(os.getpid(), signal.SIGTERM)  # collective: JAX's preemption notifier syncs them (train)
        else:
            stop.set()

    signal.signal(signal.SIGINT, on_signal)
    if not distributed:  # JAX's notifier already holds SIGTERM
        signal.signal(signal.SIGTERM, on_signal)


def start_watchdog(timeout: float, stop) -> list:
    """[time.time() of the last progress], for the learner to update. With a timeout (--stall-timeout; 0: none), a
    thread aborts the run when no progress is made for that long."""
    last_progress = [time.time()]
    if timeout:
        thread_args = (last_progress, timeout, stop)
        threading.Thread(target=watch_progress, args=thread_args, daemon=True, name="watchdog").start()
    return last_progress


def watch_progress(last_progress: list, timeout: float, stop):
    """JAX does not detect a peer that is alive but stuck (e.g. in a collective): abort instead of hanging."""
    while not stop.wait(1.0):
        if time.time() - last_progress[0] > timeout:
            print(
                f"error: no iteration completed in {timeout} s (--stall-timeout); a process or device is stuck. "
                "Stacks:",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)  # the main thread is blocked: no orderly shutdown is possible


def join_threads(threads: list):
    for thread in threads:
        if thread.ident is not None:  # started
            thread.join(timeout=30)
    if any(thread.is_alive() for thread in threads):
        print("warning: an actor thread did not stop within 30 s", file=sys.stderr)


def exit_status(stop: Stop, iterations_done: int, now: bool = False):
    """The end of a run that stopped early: the first error, of an actor thread or the learner (exit status 1), or the
    signal (128 + it). now: exit on an error at once, skipping Python's shutdown (see shut_down)."""
    if stop.errors:
        print_exception(stop.errors[0])
        print(f"the run stopped on an error ({type(stop.errors[0]).__name__})", file=sys.stderr, flush=True)
        if now:
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)
    if stop.signals:
        print(f"stopped by signal {stop.signals[0]} after iteration {iterations_done}", file=sys.stderr)
        sys.exit(128 + stop.signals[0])


def shut_down(run, save_checkpoint):
    """After a script's train, however it ended (run: its TrainingRun): every actor thread joined, a checkpoint
    (save_checkpoint(run), on every process: it gathers the replay memory) when a signal stopped the run, and the
    barrier of all processes (before process 0 evaluates, so that none waits for it)."""
    run.stop.set()
    join_threads(run.threads)
    signalled = run.stop.signals and not run.stop.errors and run.iterations_done >= run.start_iteration
    if signalled and run.args.checkpoint_frequency and save_checkpoint(run):
        print(f"checkpoint of iteration {run.iterations_done} saved to {checkpoint_path(run.run_dir)}", flush=True)
    if run.logger is not None:
        run.logger.writer.flush()
    if run.args.distributed:
        if run.stop.errors:  # the others may wait for this process in a collective, and a shutdown would wait for
            exit_status(run.stop, run.iterations_done, now=True)  # them: exit now, they abort (--heartbeat-timeout)
        jax.distributed.shutdown()


def close_and_exit(run):
    """The end of a script's run (run: its TrainingRun), after its model's evaluation: the logs closed, and the exit
    status of how the run ended."""
    if run.logger is not None:
        run.logger.close()
    exit_status(run.stop, run.iterations_done)
