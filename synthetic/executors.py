"""Where the units of a sweep (or any list of independent jobs) run: a local process pool, or Ray tasks.

Both take a picklable ``fn`` and a list of ``jobs`` and return ``[fn(job) for job in jobs]`` in finishing order.
A job must be safe to run twice (a Ray task whose worker dies is run again): the sweep's units are, since they
re-read results.jsonl under a lock and append each point once (:func:`synthetic.sweep.append_once`). Ray is an
optional extra (``pip install llmprobe[ray]``), imported only here, only when asked for.

When Ray itself fails (its raylet or GCS dies, a worker dies more often than it is retried, a cluster cannot be
joined) :func:`ray_map` raises :class:`RayFailed` (a :class:`~llmprobe.checks.UsageError`: exit status 2 with its
message), or :class:`RayOutOfMemory` (exit 3) when Ray stopped a job for want of memory; what the finished jobs
wrote stays, and running the same command again finishes the rest. A job's own exception is raised as Ray raises
it (``RayTaskError``).
"""
from __future__ import annotations

from llmprobe.checks import UsageError

RAY_MAX_RETRIES = 3          # reruns of a task whose worker process died
RAY_POLL_S = 1.0             # how often ray_map checks that the raylet and GCS it started are alive
RERUN = ("run the same command again to finish the rest (llmprobe run: with --resume; synth sweep: it skips the "
         "points already in its results.jsonl)")


class RayFailed(UsageError):
    """Ray itself failed, not a job: ``why`` says how, ``results`` holds what the jobs that finished returned."""

    def __init__(self, what: str, why: str, results: list, n_jobs: int):
        self.why, self.results = f"{what}: {why}", list(results)
        super().__init__(f"{what} ({why}) after {len(results)} of {n_jobs} jobs finished; the results already "
                         f"written are kept: {RERUN}")


class RayOutOfMemory(MemoryError):
    """Ray's memory monitor killed a job's worker (exit status 3): ``results`` as in :class:`RayFailed`."""

    def __init__(self, why: str, results: list, n_jobs: int):
        self.results = list(results)
        super().__init__(f"Ray stopped a job for want of memory ({why}) after {len(results)} of {n_jobs} jobs "
                         f"finished; the results already written are kept: use fewer CPUs per machine or a smaller "
                         f"job, then {RERUN}")


def process_map(fn, jobs: list, workers: int) -> list:
    """``fn`` over ``jobs`` in a pool of ``workers`` spawned processes."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers) as pool:
        return list(pool.imap_unordered(fn, jobs))


def ray_map(fn, jobs: list, *, address: str | None = None, max_retries: int = RAY_MAX_RETRIES,
            num_cpus: int | None = None, cpus_per_task: int = 1) -> list:
    """``fn`` over ``jobs`` as Ray tasks (``cpus_per_task`` CPUs each: a job that runs that many torch threads),
    each retried up to ``max_retries`` times when its worker dies. Uses the running Ray instance if there is one,
    else starts one: on this machine (``address`` None, ``num_cpus`` CPUs, default all) or connects to the cluster
    at ``address`` (shut down again at the end). While it waits it checks, every ``RAY_POLL_S`` seconds, that the
    raylet and GCS of a Ray started in this process are alive (left to itself, Ray ends the process a minute
    after its GCS died, exit 1 and no exception, and notices a dead raylet only when a task needs a new worker,
    ~18 s in tests/test_reliability_ray.py). Ray's own failures raise :class:`RayFailed` or
    :class:`RayOutOfMemory`."""
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray executor needs Ray: pip install 'llmprobe[ray]'") from None
    started = not ray.is_initialized()
    out: list = []
    submitted = False
    try:
        if started:
            if address:
                ray.init(address=address)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False)
        task = ray.remote(num_cpus=max(1, int(cpus_per_task)), max_retries=max_retries)(fn)
        pending = [task.remote(job) for job in jobs]
        submitted = True
        watched = _ray_processes(ray)
        while pending:
            if not watched:                       # joined a cluster: only Ray's own errors tell
                done, pending = ray.wait(pending, num_returns=1)
            else:
                done, pending = ray.wait(pending, num_returns=1, timeout=RAY_POLL_S)
                if not done:
                    dead = [f"its {kind} (pid {proc.pid}) exited with status {proc.poll()}"
                            for kind, proc in watched if proc.poll() is not None]
                    if dead:
                        raise RayFailed("the Ray cluster died", "; ".join(dead), out, len(jobs))
                    continue
            out.append(ray.get(done[0]))
        return out
    except Exception as error:
        failure = _ray_failure(ray, error, out, len(jobs), max_retries, joining=not submitted)
        if failure is None:
            raise
        raise failure from error
    finally:
        if started:
            _shutdown(ray)


def _ray_processes(ray) -> list:
    """``(kind, Popen)`` of the raylet and GCS that Ray started in this process; [] when it joined a cluster (or
    Ray's internals moved: then only Ray's own errors tell)."""
    try:
        node = ray._private.worker._global_node
        return [(kind, info.process) for kind in ("raylet", "gcs_server")
                for info in (node.all_processes or {}).get(kind, ()) if info.process is not None]
    except Exception:
        return []


def _ray_failure(ray, error: Exception, results: list, n_jobs: int, max_retries: int, joining: bool):
    """The project's error for a failure of Ray itself, or None for a job's own exception (and anything else)."""
    if isinstance(error, (RayFailed, RayOutOfMemory)):
        return None
    exceptions = getattr(ray, "exceptions", None)
    if exceptions is None:
        return None
    if isinstance(error, (exceptions.RayTaskError, exceptions.TaskCancelledError)):
        return None
    text = str(error).strip()
    why = f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__
    if isinstance(error, exceptions.OutOfMemoryError):
        return RayOutOfMemory(why, results, n_jobs)
    if isinstance(error, exceptions.WorkerCrashedError):
        return RayFailed(f"a Ray worker died running a job {max_retries + 1} times (killed, perhaps by the "
                         f"kernel for memory, or crashed)", why, results, n_jobs)
    if isinstance(error, (exceptions.RayError, ConnectionError)):
        return RayFailed("Ray could not start or join its cluster" if joining else "the Ray cluster died", why,
                         results, n_jobs)
    return None


def _shutdown(ray) -> None:
    """``ray.shutdown()``, which after the raylet or GCS died may itself fail: nothing is left to stop then."""
    try:
        ray.shutdown()
    except Exception:
        pass
