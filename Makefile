# The two commands users need:  make demo  /  make test
# A lane is a venv plus a pinned requirements file; CI runs two lanes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
REQ    ?= requirements/tf2.15.txt
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-$(notdir $(REQ))
PYTEST_ARGS ?=

export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test venv ops bench wheel-check bazel-check clean readme-table

venv: $(STAMP)

$(STAMP): $(REQ) setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade -q "pip>=23.1"
	$(BIN)/python -m pip install -q -r $(REQ)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

ops: venv
	$(BIN)/python -m npu_amp_tf._loader

demo: ops
	$(BIN)/npu-amp demo

# A test still running after TEST_TIMEOUT seconds ends the lane with every
# thread's stack printed (pytest-timeout), instead of holding CI to its limit;
# the slowest tests are listed at the end of each lane.  pytest drops its
# assertion-diff truncation when CI or BUILD_NUMBER is set, and an untruncated
# difflib diff of two long one-line strings (a report's JSON in the planted-fault
# tests, which expect the assertion to fail) is quadratic: it ran past the
# timeout on CI.  The suite runs as it does everywhere else, truncated.
TEST_TIMEOUT ?= 900
test: ops
	env -u CI -u BUILD_NUMBER $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) --timeout-method=thread \
	  --durations=25 $(PYTEST_ARGS) tests

bench: ops
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# A plain (non-editable) wheel must carry the C++ sources and build them.
wheel-check: venv
	rm -rf build/wheel-check && mkdir -p build/wheel-check
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w build/wheel-check .
	$(BIN)/python -m pip install -q --no-deps --target build/wheel-check/site build/wheel-check/*.whl
	cd build/wheel-check && NPU_AMP_TF_CACHE_DIR=$(CURDIR)/build/wheel-check/cache \
	  PYTHONPATH=site ../../$(BIN)/python -c "import npu_amp_tf, npu_amp_tf._loader as L; \
	  assert '/site/' in npu_amp_tf.__file__, npu_amp_tf.__file__; L.load(); print('wheel ok:', L.source_dir()); \
	  from npu_amp_tf.tools import report as R; [R._asset(a) for a in ('dagre.min.js', 'dagre.LICENSE', 'precision_map.html')]; \
	  print('HTML page assets ok')"

# The top-level BUILD/WORKSPACE build the same library offline with Debian's
# bazel-bootstrap (native rules only); the result must load and act.
bazel-check: venv
	$(BIN)/python configure.py
	bazel build //:libnpu_amp_tf.so //:npu_amp_tf
	NPU_AMP_TF_LIBRARY=$(CURDIR)/bazel-bin/libnpu_amp_tf.so $(BIN)/python .ci/bazel_check.py
	bazel shutdown

readme-table: venv
	$(BIN)/python -m npu_amp_tf.options README.md

clean:
	rm -rf build dist *.egg-info .venv .venv-* third_party/tensorflow/local_paths.bzl
	-bazel clean --expunge 2>/dev/null
