"""Session 10: N train steps per XLA call (lax.scan over steps, same batch) against one step per call, bench_cpu
step, one process. Arguments: rounds, N. WORKSPACE.md 2026-12-01.
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session10/ab_steps_per_call.py 8 4
"""
import time, sys, statistics, importlib.util, resource, jax, jax.numpy as jnp
sys.path.insert(0, '.')
from jaxlm import measure, train, optim, sharding, config as config_lib
spec = importlib.util.spec_from_file_location("c", "experiments/configs/bench_cpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
config = config_lib.from_config_dict(m.get_config())
mesh = sharding.make_mesh(config.mesh, None)
optimizer = optim.make_optimizer(config.train)
graphdef, state, shardings = train.init_train_state(config, mesh, optimizer)
step_fn = sharding.traced_on(mesh, train.make_train_step(graphdef, optimizer, 1, optim.learning_rate_schedule(config.train), mesh), sharding.rule_overrides(config.mesh))
batch = measure.synthetic_batch(config.train.batch_size, config.data.seq_len, config.model.vocab_size, mesh)
N = int(sys.argv[2])
one = jax.jit(step_fn, donate_argnums=0)
def multi(s, b):
  return jax.lax.scan(lambda s, _: step_fn(s, b), s, None, length=N)
many = jax.jit(multi, donate_argnums=0)
st = {"one": jax.tree.map(jnp.copy, state), "many": jax.tree.map(jnp.copy, state)}
fns = {"one": (one, N), "many": (many, 1)}
times = {k: [] for k in fns}; sys_t = {k: [] for k in fns}
for r in range(int(sys.argv[1])):
  for k, (f, calls) in fns.items():
    s = st[k]
    s, mt = f(s, batch); jax.block_until_ready(mt)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    for _ in range(calls): s, mt = f(s, batch)
    jax.block_until_ready(mt); times[k].append((time.perf_counter() - t) / N); st[k] = s
    r1 = resource.getrusage(resource.RUSAGE_SELF); sys_t[k].append((r1.ru_stime - r0.ru_stime) / N)
  print(r, {k: f"{t[-1]:.3f}" for k, t in times.items()}, {k: f"{t[-1]:.3f}" for k, t in sys_t.items()}, flush=True)
b = statistics.median(times["one"])
for k, t in times.items(): print(k, f"median {statistics.median(t):.3f}", f"speedup {b/statistics.median(t):.3f}", "paired", f"{statistics.median([x/y for x,y in zip(times['one'], t)]):.3f}")
