"""Plan a run before renting: which devices, mesh and micro-batch fit the model, how fast it trains, what it costs.

  python experiments/plan.py --config=experiments/configs/gpt2_small.py --hardware=h100_80gb,l4_24gb \
      --workdir=runs/plan_gpt2

For every layout of 1, 2, 4 and 8 devices (data x fsdp x tensor, and pipelines of each mesh.pipeline_schedule over
data x fsdp) on every --hardware profile (jaxlm/planner/hardware.json, or --hardware_file), in the compute dtype the
profile has (bf16 becomes fp16 on a V100 or T4, with a warning), it predicts the per-device memory of each
accumulation split (no compile), picks the split that fits (the fewest micro-batches; for a pipeline the fastest),
and predicts step time, MFU, wall time and cost for the token budget (hours and kWh on owned hardware), with the
kernels the run would use on that profile's platform (config.kernels, `auto` resolved there). LoRA/QLoRA configs
(lora.rank > 0) get the bytes of the frozen base, adapters, optimizer state and activations; RL configs (rl.loss) the
update step on prompt + completion sequences plus the rollout, the reference and the log-prob passes
(jaxlm/planner/estimates_rl.py: rollout_sec, update_sec, kv_cache_bytes, reference_bytes). It prints, per profile
and device count, which layout wins and why. It then compiles the train step on simulated CPU devices for each
profile's recommended layout and the one-device mesh (kernels that cannot run on a CPU as their stand-ins;
pipelines through jaxlm/training/pipeline.py's step), and reports the compiled memory and the collective bytes read from
the HLO beside the prediction. Writes <workdir>/plan.json, plan.md (the table) and plan.png. Needs no accelerator.

--hf_config=<config.json or a folder holding one> plans the model that file describes (its shape from the file alone,
no weights), with --config's training settings (batch, seq_len, LoRA/QLoRA, optimizer, kernels, dtypes):

  python experiments/plan.py --config=experiments/configs/llama_7b_qlora.py \
      --hf_config=experiments/configs/hf/llama-3.1-8b.json --hardware=l4_24gb --devices=1 --workdir=runs/plan_8b

--measure also runs the train step here (as configured, on this machine's devices) and compares the predicted step
time and memory with the measured ones: with a CPU "hardware profile" measured in the same run, or on a GPU with
--measure_hardware=<profile> (e.g. h200_141gb).
"""

import dataclasses
import os

# The planner compiles meshes of up to 8 devices on simulated CPU devices; XLA reads this flag once, when jax is
# imported, so it must be set before that import. A user's own setting (e.g. =4) is kept.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxlm import cli  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.kernels import runnable_on
from jaxlm.planner import advice, check_against_runs, estimates, estimates_moe, plan
from jaxlm.planner import estimates_preference as preference_predict
from jaxlm.planner import estimates_rl as rl_predict
from jaxlm.planner import hardware as hardware_lib
from jaxlm.planner import layouts as layouts_lib
from jaxlm.training import atomic_files  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where plan.json, plan.md and plan.png go")
_HF_CONFIG = flags.DEFINE_string("hf_config", "", "an HF config.json, or a folder holding one: its model replaces "
                                  "the config's model.* (the shape from that file alone; the dtypes stay --config's)")
_HARDWARE = flags.DEFINE_list("hardware", ["h100_80gb"], "hardware profiles (names in --hardware_file)")
_HARDWARE_FILE = flags.DEFINE_string("hardware_file", hardware_lib.PROFILES_PATH, "JSON file of hardware profiles")
_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "device counts to plan for (powers of two)")
_TOKENS = flags.DEFINE_float("tokens", 0, "token budget of the run; 0 = train.steps * train.batch_size * seq_len")
_COMPILE = flags.DEFINE_enum("compile", "recommended", ["recommended", "all", "none"],
                             "which rows to compile on simulated CPU devices (tens of seconds each on a CPU); "
                             "recommended: the one-device mesh, the cheapest row and each device count's fastest")
_CHECKPOINT_BPS = flags.DEFINE_float("checkpoint_bytes_per_sec", 1e9, "checkpoint write rate per device, bytes/s")
_RESTART_SEC = flags.DEFINE_float("restart_sec", 600, "seconds a spot run loses per preemption besides lost steps")
_MEASURE = flags.DEFINE_bool("measure", False, "also run the configured train step here and compare with prediction")
_MEASURE_HARDWARE = flags.DEFINE_string("measure_hardware", "", "profile to predict --measure with (default: "
                                        "measure this host's matmul and memory rates)")
flags.mark_flags_as_required(["config", "workdir"])


def compile_row(config, row: dict, hardware: hardware_lib.Hardware, compiled_cache: dict) -> None:
  """Adds the compiled (CPU) memory and HLO collective bytes to a row of `hardware`, for `retime`."""
  config = plan.for_hardware(plan.row_config(config, row), hardware)[0]
  layout = row_layout(row)
  sizes = layout.sizes + (layout.pipeline,)
  platform = hardware.platform or None
  here = jax.devices()[0].platform
  # Profiles whose kernels compile to the same program here (the same stand-ins) share one compile.
  key = (row["mesh"], row["schedule"], row["grad_accum"], config.model.compute_dtype,
         runnable_on(estimates.planned_kernels(config, sizes, platform), here))
  if key not in compiled_cache:
    run_config = plan.with_mesh(config, layout, row["grad_accum"])
    compiled = plan.compile_train_step(run_config, jax.devices()[:row["devices"]], platform)
    as_compiled = estimates.as_compiled_on(run_config, here, sizes, platform)
    compiled_cache[key] = (plan.compiled_memory_bytes(compiled),
                           plan.compiled_collective_bytes(compiled, row["devices"])["total"],
                           plan.predict_row_memory(as_compiled, layout, row["grad_accum"], here))
  memory, collective, predicted_as_cpu = compiled_cache[key]
  row.update({"compiled_memory_gib": memory / hardware_lib.GIB,
              "predicted_memory_as_compiled_gib": predicted_as_cpu / hardware_lib.GIB,
              "memory_prediction_error": predicted_as_cpu / memory - 1,
              "collective_bytes": collective, "collective_source": "compiled HLO"})


def row_layout(row: dict) -> layouts_lib.Layout:
  return layouts_lib.Layout(row["data"], row["fsdp"], row["tensor"], row["pipeline"], row["schedule"])


def retime(config, row: dict, hardware: hardware_lib.Hardware) -> None:
  config = plan.for_hardware(plan.row_config(config, row), hardware)[0]
  row.update(plan.predict_row_time(config, row_layout(row), row["grad_accum"], hardware, row["collective_bytes"]))


def money(value) -> str:
  return "-" if value is None else f"{value:.2f}"


def format_table(rows: list[dict]) -> str:
  header = ("| hardware | devices | layout | mesh (data x fsdp x tensor x pipeline) | dtype | fits | grad_accum x "
            "micro-batch | largest local micro-batch | memory/device GiB (predicted) | compiled (CPU) | headroom GiB | "
            "step s | network s | bubble | MFU | hours | kWh | on-demand $ | spot $ |")
  lines = [header, "|" + " --- |" * 19]
  for r in rows:
    compiled = f"{r['compiled_memory_gib']:.2f}" if "compiled_memory_gib" in r else "-"
    lines.append(
        f"| {r['hardware']} | {r['devices']} | {r['layout']} | {r['mesh']} | {r['compute_dtype']} | "
        f"{'yes' if r['fits'] else 'NO'} | {r['grad_accum']} x {r['micro_batch']} | {r['largest_local_micro_batch']} | "
        f"{r['predicted_memory_gib']:.2f} | {compiled} | {r['headroom_gib']:.2f} | {r['step_time_sec']:.3f} | "
        f"{r['network_sec']:.3f} | {100 * r['bubble_fraction']:.0f}% | {100 * r['mfu']:.1f}% | "
        f"{r['on_demand_hours']:.2f} | {money(r['energy_kwh'])} | {money(r['on_demand_usd'])} | "
        f"{money(r['spot_usd'])} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(dict.fromkeys(r["hardware"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
  for i, name in enumerate(names):
    sub = [r for r in rows if r["hardware"] == name]
    xs = [j + i / (len(names) + 1) for j in range(len(sub))]
    axes[0].bar(xs, [r["predicted_memory_gib"] for r in sub], width=1 / (len(names) + 1), label=name,
                color=[f"C{i}" if r["fits"] else "lightgray" for r in sub], edgecolor=f"C{i}")
    axes[0].axhline(sub[0]["usable_memory_gib"], color=f"C{i}", linestyle="--", linewidth=1)
    fit = [r for r in sub if r["fits"]]
    # Owned hardware has no dollars: its energy (kWh) stands on the same axis.
    cost = lambda r: r["on_demand_usd"] if r["on_demand_usd"] is not None else (r["energy_kwh"] or 0.0)
    axes[1].scatter([r["on_demand_hours"] for r in fit], [cost(r) for r in fit], color=f"C{i}", label=name)
    for r in fit:
      axes[1].annotate(r["mesh"], (r["on_demand_hours"], cost(r)), fontsize=6)
  meshes = [r["mesh"] for r in rows if r["hardware"] == names[0]]
  axes[0].set_xticks(range(len(meshes)), meshes, rotation=90, fontsize=7)
  axes[0].set_title("predicted GiB per device (grey: does not fit; dashed: usable)")
  axes[0].legend()
  axes[1].set_xscale("log")
  axes[1].set_yscale("log")
  axes[1].set_xlabel("wall hours (on-demand)")
  axes[1].set_ylabel("on-demand $ (owned hardware: kWh)")
  axes[1].set_title("cost vs time of the fitting layouts")
  axes[1].grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def expert_parallel_section(config, hardware, counts, params: dict, summary: dict) -> str:
  """A mixture of experts' total and active parameters (`params`) and, per profile and device count, its expert
  layouts (jaxlm/planner/estimates_moe.py) into `summary`; returns them as a markdown section."""
  lines = [f"\n## Expert parallelism\n\n{params['total'] / 1e9:.2f}B parameters, {params['active'] / 1e9:.2f}B "
           "active per token.\n\n| hardware | devices | mesh | fits | grad_accum | GiB per device | all-to-all GB "
           "per step | step s |\n| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for profile in hardware:
    for n in counts:
      layouts = estimates_moe.expert_layouts(config, n, profile, profile.usable_bytes)
      if not layouts:
        continue
      best = layouts[0]
      summary[f"{profile.name}/{n}_devices/expert_layout"] = best["mesh"] if best["fits"] else "none fits"
      print(f"{profile.name} x {n}: " + "; ".join(
          f"{r['mesh']} {'fits' if r['fits'] else 'does not fit'} ({r['memory_gib']:.1f} GiB, "
          f"{r['step_time_sec']:.2f} s/step)" for r in layouts))
      lines += [f"| {profile.name} | {n} | {r['mesh']} | {'yes' if r['fits'] else 'no'} | {r['grad_accum']} | "
                f"{r['memory_gib']:.1f} | {r['exchange_gb']:.1f} | {r['step_time_sec']:.3f} |" for r in layouts]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  if _HF_CONFIG.value:
    config = plan.with_hf_model(config, _HF_CONFIG.value)
  if config.model.flavour == "bert":
    raise ValueError("model.flavour=bert: the planner plans the decoder train step (jaxlm.training.loop); plan a "
                     "gpt2 or llama config")
  hardware = hardware_lib.load_hardware(_HARDWARE.value, _HARDWARE_FILE.value)
  counts = [int(n) for n in _DEVICES.value]
  if any(n < 1 or n & (n - 1) for n in counts):
    raise ValueError(f"--devices={','.join(_DEVICES.value)} must be powers of two (1, 2, 4, 8)")
  # A preference pair is two sequences (jaxlm/planner/estimates_preference.py), an RL completion one of prompt +
  # completion tokens (jaxlm/planner/estimates_rl.py): the tokens the steps process.
  sequences = preference_predict.SEQUENCES_PER_PAIR if config.preference.loss else 1
  seq_len = rl_predict.as_sequence_run(config).data.seq_len if config.rl.loss else config.data.seq_len
  assumptions = plan.RunAssumptions(
      tokens=_TOKENS.value or config.train.steps * config.train.batch_size * sequences * seq_len,
      checkpoint_every_steps=config.checkpoint.every_steps, checkpoint_bytes_per_sec=_CHECKPOINT_BPS.value,
      restart_sec=_RESTART_SEC.value)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = plan.plan(config, hardware, counts, assumptions)
  if config.preference.loss:
    print(f"preference tuning ({config.preference.loss}): {config.train.batch_size} pairs per step planned as "
          f"{sequences * config.train.batch_size} sequences; the reference pass before the first step is in the hours "
          f"(reference_pass_sec)")
    config = preference_predict.as_sequence_run(config)  # what the compile checks build
  if config.rl.loss:
    rl = config.rl
    config = rl_predict.as_sequence_run(config)  # what the compile checks build: the update step
    prompt = config.data.seq_len - rl.max_completion_length
    print(f"RL ({rl.loss}): each step updates on {config.train.batch_size} completions of {prompt} prompt + "
          f"{rl.max_completion_length} completion tokens (data.seq_len, or {rl_predict.DEFAULT_PROMPT_LENGTH} "
          f"assumed when 0), one rollout every {rl.num_iterations} steps; rollout_sec, update_sec, kv_cache_bytes "
          f"and reference_bytes in plan.json")
  for profile in hardware:
    if not any(r["hardware"] == profile.name for r in rows):
      print(f"{profile.name}: no mesh can run this config; on one device: "
            f"{plan.mesh_problem(config, (1, 1, 1), profile.platform or None) or 'see --devices'}")
  if not rows:
    raise ValueError("no mesh can run this config on the given devices (heads or batch not divisible, or a kernel "
                     "in config.kernels the devices cannot run); try other --devices, train.batch_size or kernels")

  params = estimates_moe.parameter_counts(config.model)
  summary = {"config": _CONFIG.value.to_json(), "hf_config": _HF_CONFIG.value,
             "model": dataclasses.asdict(config.model), "total_params": params["total"],
             "active_params": params["active"], "tokens": assumptions.tokens,
             "cpu_devices_simulated": jax.device_count()}
  model_source = f" from {_HF_CONFIG.value}" if _HF_CONFIG.value else ""
  print(f"model{model_source}: {params['total'] / 1e9:.2f}B parameters ({params['total']:,})")
  explanations = []
  for profile in hardware:
    best = advice.recommend(rows, profile.name)
    summary[f"{profile.name}/recommended_mesh"] = best["mesh"] if best else "none fits"
    note = next((r["hardware_note"] for r in rows if r["hardware"] == profile.name and r["hardware_note"]), "")
    if note:
      summary[f"{profile.name}/hardware_note"] = note
      logging.warning("%s", note)
    if best:
      summary[f"{profile.name}/kernels"] = best["kernels"]
      print(f"{profile.name}: kernels {best['kernels']}")
      summary[f"{profile.name}/recommended_layout"] = best["layout"]
      summary[f"{profile.name}/recommended_grad_accum"] = best["grad_accum"]
      summary[f"{profile.name}/recommended_micro_batch"] = best["micro_batch"]
      summary[f"{profile.name}/recommended_on_demand_usd"] = best["on_demand_usd"]
      summary[f"{profile.name}/recommended_hours"] = best["on_demand_hours"]
      summary[f"{profile.name}/recommended_energy_kwh"] = best["energy_kwh"]
      if config.lora.rank:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in best["memory_parts_gib"].items())
        print(f"{profile.name}: LoRA ({best['lora']}) per device GiB: {parts}")
    for n in counts:
      if any(r["hardware"] == profile.name and r["devices"] == n for r in rows):
        text = advice.explain(rows, profile, n)
        summary[f"{profile.name}/{n}_devices"] = text
        explanations.append(text)
        print(text)
    message = advice.does_not_fit_message(rows, profile.name)
    if message:
      summary[f"{profile.name}/one_device"] = message
      print(f"{profile.name}: {message}")
  expert_table = (expert_parallel_section(config, hardware, counts, params, summary) if config.model.num_experts
                  else "")
  # After the recommendations and explanations, which compare every layout on the same (analytic) footing.
  compiled_cache: dict = {}
  for profile in hardware:
    chosen = [r for r in rows if r["hardware"] == profile.name]
    if _COMPILE.value == "recommended":  # the one-device mesh, the cheapest row and each device count's winner
      winners = [advice.ranked(rows, profile.name, n)[:1] for n in counts]
      keep = [advice.recommend(rows, profile.name)] + [w[0] for w in winners if w and w[0]["fits"]]
      chosen = [r for r in chosen if (r["devices"] == 1 and r["pipeline"] == 1) or any(r is k for k in keep)]
    elif _COMPILE.value == "none":
      chosen = []
    for row in chosen:
      if row["devices"] <= jax.device_count():
        compile_row(config, row, profile, compiled_cache)
        retime(config, row, profile)

  if _MEASURE.value:
    measure_profile = hardware_lib.load_hardware([_MEASURE_HARDWARE.value], _HARDWARE_FILE.value)[0] \
        if _MEASURE_HARDWARE.value else None
    check = check_against_runs.check_step_prediction(config, jax.devices(), measure_profile)
    summary.update({f"measure/{k}": v for k, v in check.items() if not isinstance(v, dict)})
    summary.update({f"measure/predicted_{k}": v for k, v in check["predicted"].items()})
    summary["measure/hardware"] = check["hardware"]["description"]
    print(f"measured here on mesh {check['mesh']}: step {check['measured_step_time_sec']:.4f} s, predicted "
          f"{check['predicted_step_time_sec']:.4f} s ({100 * check['step_time_error']:+.1f}%); memory compiled "
          f"{check['compiled_memory_bytes'] / 2**20:.1f} MiB, predicted {check['predicted_memory_bytes'] / 2**20:.1f} "
          f"MiB ({100 * (check['predicted_memory_bytes'] / check['compiled_memory_bytes'] - 1):+.1f}%)")

  flat_rows = []
  for r in rows:
    flat = {k: v for k, v in r.items() if k != "memory_parts_gib"}
    flat.update({f"memory_{k}_gib": v for k, v in r["memory_parts_gib"].items()})
    flat_rows.append(flat)
  atomic_files.write_json(os.path.join(_WORKDIR.value, "plan.json"), {**summary, "rows": flat_rows})
  table = format_table(rows)
  kernels = "".join(f"\n- {name}: {summary[f'{name}/kernels']}" for name in (p.name for p in hardware)
                    if f"{name}/kernels" in summary)
  atomic_files.write_text(os.path.join(_WORKDIR.value, "plan.md"),
                   f"# Plan for {config.model.flavour} d{config.model.d_model} x {config.model.num_layers} layers "
                   f"({params['total'] / 1e9:.2f}B parameters{model_source}), batch {config.train.batch_size} x "
                   f"{config.data.seq_len}, {assumptions.tokens:.3g} tokens\n\n"
                   f"{table}\n\nKernels of each recommended mesh (config.kernels resolved for the hardware):"
                   f"{kernels}\n\nWhich layout wins:\n"
                   + "".join(f"\n- {text}" for text in explanations) + "\n" + expert_table)
  plot(rows, os.path.join(_WORKDIR.value, "plan.png"))
  print(table)
  print(f"wrote {_WORKDIR.value}/plan.json, plan.md, plan.png")


if __name__ == "__main__":
  cli.run(main)
