"""Where the units of a sweep (or any list of independent jobs) run: a local process pool, or Ray tasks.

Both take a picklable ``fn`` and a list of ``jobs`` and return ``[fn(job) for job in jobs]`` in finishing order.
A job must be safe to run twice (a Ray task whose worker dies is run again): the sweep's units are, since they
re-read results.jsonl under a lock and append each point once (:func:`synthetic.sweep.append_once`). Ray is an
optional extra (``pip install llmprobe[ray]``), imported only here, only when asked for.
"""
from __future__ import annotations

RAY_MAX_RETRIES = 3          # reruns of a task whose worker process died


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
    at ``address`` (shut down again at the end)."""
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray executor needs Ray: pip install 'llmprobe[ray]'") from None
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False)
    try:
        task = ray.remote(num_cpus=max(1, int(cpus_per_task)), max_retries=max_retries)(fn)
        pending = [task.remote(job) for job in jobs]
        out = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            out.append(ray.get(done[0]))
        return out
    finally:
        if started:
            ray.shutdown()
