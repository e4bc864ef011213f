# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# 4 simulated CPU devices, so the tests and the demo exercise real meshes without an accelerator; huge pages for
# malloc as the scripts would set themselves (jaxlm.cli), so their subprocesses need not re-execute.
CPU_DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu GLIBC_TUNABLES=glibc.malloc.hugetlb=1

.PHONY: demo test soak install install-test clean

# uv installs the same requirements (bytecode compiled, as pip does) in half of pip's time; pip's local wheels go along,
# and pip itself is the fallback where uv cannot run.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) $(if $(FIND_LINKS),--find-links $(FIND_LINKS))

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv

$(VENV)/.installed: pyproject.toml | $(PY)
	$(UV_INSTALL) -e . || $(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(UV_INSTALL) -e ".[dev,hf]" || $(PY) -m pip install --quiet -e ".[dev,hf]"
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(CPU_DEVICES) $(PY) experiments/train_lm.py --config=experiments/configs/demo.py --workdir=runs/demo

# --no-loadscope-reorder: xdist would hand out the files by their number of tests; tests/conftest.py orders them
# longest first, so the two workers end together.
test: install-test
	$(CPU_DEVICES) $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

# Kills a small training run at random moments (SIGKILL and SIGTERM), resumes it each time and checks every step's
# loss against an uninterrupted run, bit for bit (experiments/soak.py; about 15 s per kill on a 2-core CPU).
soak: install
	$(CPU_DEVICES) $(PY) experiments/soak.py --kills=12 --workdir=runs/soak

clean:
	rm -rf $(VENV) runs
