# moss-image-scripts: `make demo` runs the main job on the embedded tiny snapshot; `make test` runs the suite.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_out

.PHONY: demo test venv clean

$(STAMP): requirements.txt requirements-test.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --disable-pip-version-check -q -r requirements-test.txt
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q tests

demo: $(STAMP)
	$(VPY) tools/demo.py --out $(DEMO_DIR)

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
