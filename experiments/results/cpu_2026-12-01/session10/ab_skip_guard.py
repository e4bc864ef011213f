"""Session 10: the train step's non-finite skip guard in two other forms, against train.make_train_step's, on
the bench_cpu step in one process (rounds interleaved, a warm-up step each). `guard_pre`: finite decided from loss and
grad norm before the update (selects after it); `cond`: the whole update under lax.cond. WORKSPACE.md 2026-12-01.
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session10/ab_skip_guard.py 8 guard_pre
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session10/ab_skip_guard.py 8 cond
"""
import time, sys, statistics, importlib.util, jax, jax.numpy as jnp, optax
sys.path.insert(0, '.')
from jaxlm import measure, train, config as config_lib
spec = importlib.util.spec_from_file_location("c", "experiments/configs/bench_cpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
config = config_lib.from_config_dict(m.get_config())
orig = train.make_train_step
def _metrics(loss, count, aux, grad_norm, update_norm, params, learning_rate, finite):  # train.make_train_step's
  return {"loss": loss, "token_accuracy": aux["correct"] / jnp.maximum(count, 1.0), "tokens": count,
          "grad_norm": grad_norm, "update_norm": update_norm, "param_norm": train.global_norm(params),
          "learning_rate": learning_rate, "skipped_steps": 1.0 - finite.astype(jnp.float32)}
def guard_pre(graphdef, optimizer, grad_accum, schedule, mesh=None, gradient_sync="auto", loss_fn=None):
  gradient_fn = train.make_gradient_fn(loss_fn or train.make_loss_fn(graphdef), grad_accum, mesh, gradient_sync)
  def train_step(state, batch):
    loss, count, grads, aux = gradient_fn(state["params"], batch)
    grad_norm = train.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), (params, opt_state), (state["params"], state["opt_state"]))
    update_norm = train.global_norm(updates)
    metrics = _metrics(loss, count, aux, grad_norm, update_norm, params, schedule(state["step"]), finite)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics
  return train_step
def cond(graphdef, optimizer, grad_accum, schedule, mesh=None, gradient_sync="auto", loss_fn=None):
  gradient_fn = train.make_gradient_fn(loss_fn or train.make_loss_fn(graphdef), grad_accum, mesh, gradient_sync)
  def train_step(state, batch):
    loss, count, grads, aux = gradient_fn(state["params"], batch)
    grad_norm = train.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    def apply(args):
      params, opt_state, grads = args
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, train.global_norm(updates)
    def skip(args):
      params, opt_state, grads = args
      return params, opt_state, jnp.full((), jnp.nan, jnp.float32)
    params, opt_state, update_norm = jax.lax.cond(finite, apply, skip, (state["params"], state["opt_state"], grads))
    metrics = _metrics(loss, count, aux, grad_norm, update_norm, params, schedule(state["step"]), finite)
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics
  return train_step
VARIANTS = {"guard_pre": guard_pre, "cond": cond}
runs = {"base": list(measure.compiled_train_step(config)[:3])}
for name in sys.argv[2].split(","):
  train.make_train_step = VARIANTS[name]
  runs[name] = list(measure.compiled_train_step(config)[:3])
  train.make_train_step = orig
times = {k: [] for k in runs}
for r in range(int(sys.argv[1])):
  for k, v in runs.items():
    c, s, b = v
    s, mt = c(s, b); jax.block_until_ready(mt)
    t = time.perf_counter()
    for _ in range(2): s, mt = c(s, b)
    jax.block_until_ready(mt); times[k].append((time.perf_counter() - t) / 2); v[1] = s
  print(r, {k: f"{t[-1]:.3f}" for k, t in times.items()}, flush=True)
b = statistics.median(times["base"])
for k, t in times.items(): print(k, f"median {statistics.median(t):.3f}", f"speedup {b/statistics.median(t):.3f}", "paired", f"{statistics.median([x/y for x,y in zip(times['base'], t)]):.3f}")
