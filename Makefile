# Thin wrapper over CMake. `make` builds and says which backends it built,
# `make test` runs every test under ASan+UBSan (and the threaded stress test
# under TSan), `make check` runs the unit tests without sanitizers (the edit
# loop), `make demo` runs the main job, `make install PREFIX=...` installs.
PREFIX ?= /usr/local
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE ?= cmake

.PHONY: all build test check demo install bench fuzz clean

all: build

build:
	@$(CMAKE) -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=$(PREFIX) >/dev/null
	@$(CMAKE) --build build -j $(JOBS)
	@cat build/cca-backends.txt

test:
	@sh scripts/run-tests.sh

check:
	@sh scripts/check.sh

demo: build
	@sh scripts/demo.sh

bench: build
	@./build/bench/bench_gpu --backend sim
	@./build/bench/bench_host
	@./build/bench/bench_floor
	@./build/bench/bench_replay
	@./build/bench/bench_stats_merge
	@./build/bench/bench_plan_loops

fuzz:
	@sh scripts/fuzz.sh

install: build
	@$(CMAKE) --install build --prefix $(PREFIX)

clean:
	rm -rf build build-asan build-tsan build-fuzz build-check
