"""Train a GPT language model.

  python experiments/train_lm.py --config=experiments/configs/demo.py --workdir=runs/demo
  python experiments/train_lm.py --config=experiments/configs/gpt2_small.py --config.train.steps=2000 --workdir=runs/x

Re-running with the same --workdir resumes from its latest checkpoint.
"""

from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.parallel import distributed
from jaxlm.recipes import data_checks, pretraining

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (experiments/configs/*.py)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run folder: checkpoints, metrics.jsonl, report.md")
_STOP_AT_STEP = flags.DEFINE_integer("stop_at_step", None, "checkpoint after this step and exit, as a preemption "
                                     "would (re-running the same command resumes); for tests and rehearsals")
_EXIT_CODE_WHEN_STOPPED = flags.DEFINE_integer(
    "exit_code_when_stopped", 0, "exit status after a signal stopped the run early, its checkpoint saved: 0, a "
    "clean stop, suits SLURM (launch/slurm.sbatch requeues the job itself) and local runs; launch/k8s/jobset.yaml "
    "sets 75 so that Kubernetes replaces the pod instead of counting it as done")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = config_lib.from_config_dict(_CONFIG.value)
  data_checks.check_corpus(config)  # a bad corpus file is the first line, before the kernels and the model
  distributed.initialize()  # a no-op unless launched as several processes (launch/local.sh, SLURM, Kubernetes)
  summary = pretraining.train(config, _WORKDIR.value, stop_at_step=_STOP_AT_STEP.value)
  if "preempted_at_step" in summary:  # a stop signal or --stop_at_step: checkpoint saved; by default exit 0, a clean stop
    print(f"stopped after step {summary['preempted_at_step']} (checkpoint saved); "
          f"re-run the same command to resume")
    return _EXIT_CODE_WHEN_STOPPED.value
  if summary.get("resumed_from_step", -1) == summary.get("steps"):  # a requeued or repeated command: nothing left
    print(f"already complete: step {summary['steps']} of {summary['steps']}, last logged loss "
          f"{summary.get('loss', float('nan')):.4f}; report in {_WORKDIR.value}/report.md")
    return
  print(f"done: loss {summary.get('loss', float('nan')):.4f}, report in {_WORKDIR.value}/report.md")


if __name__ == "__main__":
  cli.run(main)
