#!/bin/sh
# The main job: replay a real PyTorch trace (GPT-2 small training, recorded
# by PyTorch 2.11 on an H200) through cca on a simulated device, check that
# every allocation lands where PyTorch put it, then compare settings.
set -eu
cd "$(dirname "$0")/.."
trace=examples/gpt2_train_default.pickle.gz
echo "== cca replay $trace (PyTorch's segment addresses, PyTorch's settings)"
./build/cca replay "$trace" --addresses trace
echo
echo "== what other settings would have needed"
./build/cca replay "$trace" --compare '' 'max_split_size_mb:64' 'max_split_size_mb:256' \
    'roundup_power2_divisions:4' 'roundup_power2_divisions:[256:1,512:2,1024:4,>:8]' \
    'garbage_collection_threshold:0.7,per_process_memory_fraction:0.07' 'expandable_segments:True' \
    'compact_memory:True'
