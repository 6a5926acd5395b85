/* inspect.c - stepd-inspect: validate a checkpoint and print its load plan
 * without reading tensor data.
 *
 *   stepd-inspect MODEL_DIR [--world-size N] [--rank R] [--mtp K] [--mtp-model DIR]
 *                 [--json] [--list] [--strict]
 *                 [--device-memory BYTES [--gpu-memory-utilization F] [--overhead BYTES]
 *                  | --kv-cache-memory BYTES] [--max-model-len L] [--max-num-seqs S]
 *                 [--max-batched-tokens T] [--block-size BS] [--kv-cache-dtype bf16|fp32]
 *
 * For every rank (or the one given) it runs the loader in headers-only mode and
 * prints tensors, bytes, experts held, the MTP depth actually planned, the planning
 * time, every warning and every problem.  --mtp defaults to all MTP layers the config
 * declares.  MTP layers that are incomplete are what a worker makes of them: every missing
 * name is listed, the plan is the trunk's (served without speculation) and the rank counts
 * as loadable - unless --strict, which fails a plan whose MTP depth is below the one
 * requested.
 * Memory plan (with --device-memory or --kv-cache-memory): per rank the weights, the
 * activations worker/model reserves (kvplan_workspace_bytes, the model's own figure), the
 * overhead allowed for the runtime and the backend's scratch (default 1 GiB, an
 * estimate), the KV budget left (F x device memory minus those; or --kv-cache-memory),
 * and what the engine's two pools get from it (kvplan.h): blocks, tokens, bytes per token,
 * how many sequences of --max-model-len the full pool holds, or why it does not fit and
 * the longest --max-model-len that would.  The group runs with the smallest pools any
 * rank allows (the worker agrees on them at start-up).  Defaults as stepd-worker's:
 * --max-num-seqs 8, --max-batched-tokens 256, --block-size 16, BF16; --max-model-len
 * the config's max_position_embeddings.
 * Exit status: 0 when every inspected rank is loadable (and, with a memory plan, fits),
 * 1 when some rank is not, 2 on a usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include <jansson.h>

#include "clock.h"
#include "cli.h"
#include "config.h"
#include "kvplan.h"
#include "loader.h"
#include "stepd-config.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: stepd-inspect MODEL_DIR [--world-size N] [--rank R] [--mtp K] [--mtp-model DIR] [--json] [--list]\n"
               "         [--device-memory BYTES [--gpu-memory-utilization F] [--overhead BYTES] | --kv-cache-memory BYTES]\n"
               "         [--max-model-len L] [--max-num-seqs S] [--max-batched-tokens T] [--block-size BS]\n"
               "         [--kv-cache-dtype auto|bf16|fp32] [--strict]\n"
               "Validate a checkpoint and print each rank's load plan without reading tensor data.\n"
               "  -n, --world-size N          ranks in the group: 1, 2, 4, 8 (default 1)\n"
               "  -r, --rank R                only this rank (default: every rank)\n"
               "  -k, --mtp K                 MTP layers to plan (default: every one config.json declares)\n"
               "  -m, --mtp-model DIR         MTP layers from another directory\n"
               "  -j, --json                  one JSON document instead of text\n"
               "  -l, --list                  list every tensor of the plan\n"
               "  -s, --strict                a plan whose MTP depth is below --mtp fails the rank\n"
               "Memory plan (with --device-memory or --kv-cache-memory):\n"
               "  --device-memory BYTES       one device's memory (e.g. 80GiB)\n"
               "  --gpu-memory-utilization F  share of it the worker uses (default 0.9)\n"
               "  --overhead BYTES            runtime and backend scratch allowed (default 1GiB)\n"
               "  --kv-cache-memory BYTES     the KV budget per rank instead of the device's\n"
               "  --max-model-len L           longest sequence (default: max_position_embeddings)\n"
               "  --max-num-seqs S            sequences per step (default 8)\n"
               "  --max-batched-tokens T      tokens per step (default 256)\n"
               "  --block-size BS             tokens per KV block (default 16)\n"
               "  --kv-cache-dtype D          auto or bf16 (default), fp32\n"
               "  -V, --version, -h, --help\n"
               "Exit status: 0 every rank loadable (and fits), 1 some rank not, 2 usage.\n");
}

/* The memory plan's inputs (see the header). */
struct mplan {
    bool on;
    int64_t device, kv_budget, overhead;
    double util;
    int max_model_len, max_seqs, max_tokens, block_size, elem;
    int32_t group_full, group_sliding;  /* smallest pools over the ranks seen */
    int64_t seq_blocks;
};

/* n bytes in binary units, into one of four rotating buffers (for one printf) */
static const char *fb(int64_t n)
{
    static char buf[4][32];
    static int i;
    i = (i + 1) % 4;
    return kvplan_fmt_bytes(n, buf[i], sizeof(buf[i]));
}

/* The memory plan of rank r (ckpt c): into jr when given, else printed.  Returns 0 when
 * the KV cache fits, 1 when it does not. */
static int memory_plan(struct mplan *mp, struct ckpt *c, int ws, int r, json_t *jr)
{
    const struct model_config *cfg = ckpt_config(c);
    struct ckpt_plan_stats st;
    struct kvplan_req q;
    struct kvplan p;
    struct err_buf e = { "" };
    int k = ckpt_mtp_depth(c);
    int64_t act, budget, bpt[2];

#define OUT(...) do { if (!jr) printf(__VA_ARGS__); } while (0)
    ckpt_plan_stats(c, &st);
    kvplan_bytes_per_token(cfg, ws, r, k, mp->elem, bpt);
    act = kvplan_workspace_bytes(cfg, ws, r, k, mp->max_tokens, mp->max_seqs, mp->max_tokens);
    budget = mp->kv_budget > 0 ? mp->kv_budget
                               : (int64_t) (mp->util * (double) mp->device) - st.bytes - act -
                                     mp->overhead;
    q = (struct kvplan_req) {
        .block_size = mp->block_size, .max_num_seqs = mp->max_seqs,
        .max_model_len = mp->max_model_len, .max_batched_tokens = mp->max_tokens,
        .sliding_window = cfg->sliding_window, .mtp_margin = k < KVPLAN_MAX_DRAFTS ? k : KVPLAN_MAX_DRAFTS,
        .bytes_per_token = { bpt[0], bpt[1] },
    };
    int rc = kvplan_compute(&q, budget < 0 ? 0 : budget, &p, &e);
    /* the longest max_model_len whose one sequence fits beside the sliding pool */
    int64_t longest = -1;
    if (rc == -ENOSPC && bpt[KVPLAN_FULL] > 0 && budget > p.bytes[KVPLAN_SLIDING])
        longest = (budget - p.bytes[KVPLAN_SLIDING]) / p.block_bytes[KVPLAN_FULL] * mp->block_size -
                  KVPLAN_MAX_DRAFTS;
    OUT("  memory: weights %s, activations %s", fb(st.bytes), fb(act));
    if (mp->kv_budget > 0)
        OUT(", KV budget %s (--kv-cache-memory)\n", fb(budget));
    else
        OUT(", overhead %s: KV budget %s of %.2f x %s\n", fb(mp->overhead), fb(budget < 0 ? 0 : budget),
            mp->util, fb(mp->device));
    if (rc == 0) {
        OUT("  KV: full-attention pool %d blocks = %lld tokens (%lld B/token, %s), "
            "sliding-window pool %d blocks = %lld tokens (%lld B/token, %s)\n",
            p.n_blocks[KVPLAN_FULL], (long long) p.n_blocks[KVPLAN_FULL] * mp->block_size,
            (long long) bpt[KVPLAN_FULL], fb(p.bytes[KVPLAN_FULL]), p.n_blocks[KVPLAN_SLIDING],
            (long long) p.n_blocks[KVPLAN_SLIDING] * mp->block_size, (long long) bpt[KVPLAN_SLIDING],
            fb(p.bytes[KVPLAN_SLIDING]));
        OUT("  fits: %d sequences of %d tokens at once (at least %s needed)\n", p.full_seqs,
            mp->max_model_len, fb(p.min_bytes));
        if (p.n_blocks[KVPLAN_FULL] < mp->group_full || mp->group_full < 0)
            mp->group_full = p.n_blocks[KVPLAN_FULL];
        if (p.n_blocks[KVPLAN_SLIDING] < mp->group_sliding || mp->group_sliding < 0)
            mp->group_sliding = p.n_blocks[KVPLAN_SLIDING];
        mp->seq_blocks = p.seq_blocks;
    } else {
        OUT("  does NOT fit: %s", e.msg);
        if (longest > 0)
            OUT("; the longest --max-model-len that fits is %lld", (long long) longest);
        OUT("\n");
        mp->group_full = 0;
    }
    if (jr) {
        json_t *jm = json_pack("{s:I, s:I, s:I, s:b, s:I, s:I, s:I, s:I, s:i, s:I}",
                               "weights_bytes", (json_int_t) st.bytes, "activations_bytes", (json_int_t) act,
                               "kv_budget_bytes", (json_int_t) budget, "fits", rc == 0,
                               "full_blocks", (json_int_t) (rc == 0 ? p.n_blocks[KVPLAN_FULL] : 0),
                               "sliding_blocks", (json_int_t) (rc == 0 ? p.n_blocks[KVPLAN_SLIDING] : 0),
                               "full_bytes_per_token", (json_int_t) bpt[KVPLAN_FULL],
                               "sliding_bytes_per_token", (json_int_t) bpt[KVPLAN_SLIDING],
                               "max_model_len_seqs", rc == 0 ? p.full_seqs : 0,
                               "longest_max_model_len", (json_int_t) (rc == 0 ? mp->max_model_len : longest));
        if (rc < 0)
            json_object_set_new(jm, "error", json_string(e.msg));
        json_object_set_new(jr, "memory", jm);
    }
    return rc == 0 ? 0 : 1;
#undef OUT
}

static double now_ms(void)
{
    return (double)clk_now_ns() / 1e6;
}

/* CPU time of this thread: the planning cost without other processes' load */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

static int parse_int(const char *s, const char *what, int lo, int hi, int *ret)
{
    struct err_buf e;
    int r = cli_parse_int(what, s, lo, hi, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-inspect: %s\n", e.msg);
    return r;
}

/* split "a\nb\n" into a JSON array of strings */
static json_t *lines_json(const char *text)
{
    json_t *a = json_array();
    while (text && *text) {
        const char *nl = strchr(text, '\n');
        size_t n = nl ? (size_t) (nl - text) : strlen(text);
        json_array_append_new(a, json_stringn(text, n));
        text += n + (nl ? 1 : 0);
    }
    return a;
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "world-size", required_argument, NULL, 'n' },
        { "rank", required_argument, NULL, 'r' },
        { "mtp", required_argument, NULL, 'k' },
        { "mtp-model", required_argument, NULL, 'm' },
        { "json", no_argument, NULL, 'j' },
        { "device-memory", required_argument, NULL, 'D' },
        { "gpu-memory-utilization", required_argument, NULL, 'U' },
        { "overhead", required_argument, NULL, 'O' },
        { "kv-cache-memory", required_argument, NULL, 'M' },
        { "max-model-len", required_argument, NULL, 'L' },
        { "max-num-seqs", required_argument, NULL, 'S' },
        { "max-batched-tokens", required_argument, NULL, 'T' },
        { "block-size", required_argument, NULL, 'B' },
        { "kv-cache-dtype", required_argument, NULL, 'd' },
        { "list", no_argument, NULL, 'l' },
        { "strict", no_argument, NULL, 's' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, 'V' },
        { 0 },
    };
    int ws = 1, only_rank = -1, K = -1, opt, bad = 0, nofit = 0;
    bool as_json = false, list = false, strict = false;
    const char *mtp_dir = NULL, *dir;
    json_t *out = NULL, *ranks = NULL;
    struct mplan mp = { .util = 0.9, .overhead = 1ll << 30, .max_seqs = 8, .max_tokens = 256,
                        .block_size = 16, .elem = 2, .group_full = -1, .group_sliding = -1 };
    struct err_buf pe;

#define BYTES(flag, dst) do { if (cli_parse_bytes(flag, optarg, 1, INT64_MAX / 2, dst, &pe) < 0) { \
        fprintf(stderr, "stepd-inspect: %s\n", pe.msg); return 2; } } while (0)
    while ((opt = getopt_long(argc, argv, "n:r:k:m:jlshV", longopts, NULL)) != -1) {
        switch (opt) {
        case 'D': BYTES("--device-memory", &mp.device); mp.on = true; break;
        case 'M': BYTES("--kv-cache-memory", &mp.kv_budget); mp.on = true; break;
        case 'O': BYTES("--overhead", &mp.overhead); break;
        case 'U':
            if (cli_parse_fraction("--gpu-memory-utilization", optarg, 0, 1, &mp.util, &pe) < 0) {
                fprintf(stderr, "stepd-inspect: %s\n", pe.msg);
                return 2;
            }
            break;
        case 'L':
            if (parse_int(optarg, "--max-model-len", 2, 1 << 24, &mp.max_model_len) < 0)
                return 2;
            break;
        case 'S':
            if (parse_int(optarg, "--max-num-seqs", 1, 4096, &mp.max_seqs) < 0)
                return 2;
            break;
        case 'T':
            if (parse_int(optarg, "--max-batched-tokens", 4, 1 << 20, &mp.max_tokens) < 0)
                return 2;
            break;
        case 'B':
            if (parse_int(optarg, "--block-size", 1, 4096, &mp.block_size) < 0)
                return 2;
            break;
        case 'd': {
            bool f32;

            if (cli_parse_kv_dtype("--kv-cache-dtype", optarg, &f32, &pe) < 0) {
                fprintf(stderr, "stepd-inspect: %s\n", pe.msg);
                return 2;
            }
            mp.elem = f32 ? 4 : 2;
            break;
        }
        case 'n':
            if (parse_int(optarg, "--world-size", 1, 8, &ws) < 0)
                return 2;
            break;
        case 'r':
            if (parse_int(optarg, "--rank", 0, 7, &only_rank) < 0)
                return 2;
            break;
        case 'k':
            if (parse_int(optarg, "--mtp", 0, MODEL_MAX_LAYERS, &K) < 0)
                return 2;
            break;
        case 'm': mtp_dir = optarg; break;
        case 'j': as_json = true; break;
        case 'l': list = true; break;
        case 's': strict = true; break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("stepd-inspect %s\n", STEPD_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc - 1) {
        usage(stderr);
        return 2;
    }
    dir = argv[optind];
    if (ws != 1 && ws != 2 && ws != 4 && ws != 8) {
        fprintf(stderr, "stepd-inspect: --world-size %d: must be 1, 2, 4 or 8\n", ws);
        return 2;
    }
    if (only_rank >= ws) {
        fprintf(stderr, "stepd-inspect: --rank %d: must be below the world size %d\n", only_rank, ws);
        return 2;
    }
    if (K < 0) {
        struct model_config cfg;
        struct err_buf e;
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/config.json", dir);
        if (model_config_load(path, &cfg, &e) < 0) {
            if (as_json) {
                json_t *o = json_pack("{s:s, s:b, s:[s]}", "model_dir", dir, "ok", 0, "problems", e.msg);
                json_dumpf(o, stdout, JSON_INDENT(2));
                putchar('\n');
                json_decref(o);
            } else {
                printf("%s: NOT loadable\n  %s\n", dir, e.msg);
            }
            return 1;
        }
        K = cfg.n_mtp_layers;
    }
    if (mp.on && !mp.max_model_len) {
        struct model_config cfg;
        struct err_buf e;
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/config.json", dir);
        if (model_config_load(path, &cfg, &e) < 0) {
            printf("%s: NOT loadable\n  %s\n", dir, e.msg);
            return 1;
        }
        mp.max_model_len = cfg.max_position_embeddings;
    }
    if (as_json) {
        out = json_pack("{s:s, s:i, s:i, s:s?}", "model_dir", dir, "world_size", ws, "mtp_requested", K,
                        "mtp_model", mtp_dir);
        ranks = json_array();
        json_object_set_new(out, "ranks", ranks);
    } else {
        printf("%s: world size %d, MTP depth requested %d%s%s\n", dir, ws, K, mtp_dir ? ", --mtp-model " : "",
               mtp_dir ? mtp_dir : "");
    }
    if (mp.on && !as_json) {
        printf("memory plan: --max-model-len %d, --max-num-seqs %d, %d tokens per step, blocks of %d, "
               "KV %s", mp.max_model_len, mp.max_seqs, mp.max_tokens, mp.block_size,
               mp.elem == 2 ? "BF16" : "FP32");
        if (mp.kv_budget > 0)
            printf(", --kv-cache-memory %s per rank\n", fb(mp.kv_budget));
        else
            printf(", %s per device x %.2f\n", fb(mp.device), mp.util);
    }
    const bool tty = isatty(STDERR_FILENO);

    for (int r = 0; r < ws; r++) {
        struct ckpt_opts o = { .mtp_dir = mtp_dir, .world_size = ws, .rank = r, .mtp_depth = K,
                               .headers_only = true };
        struct ckpt *c = NULL;
        struct err_buf e = { "" };
        char *report = NULL;
        double t0, c0, ms, cms;
        int rc;

        if (only_rank >= 0 && r != only_rank)
            continue;
        o.ret_report = &report;
        if (tty)    /* on a terminal: which rank is being planned (the shards' headers read) */
            fprintf(stderr, "\rstepd-inspect: planning rank %d of %d ...\033[K", r, ws);
        t0 = now_ms();
        c0 = cpu_ms();
        rc = ckpt_open(dir, &o, &c, &e);
        ms = now_ms() - t0;
        cms = cpu_ms() - c0;
        if (tty)
            fprintf(stderr, "\r\033[K");
        if (rc < 0) {
            bad = 1;
            if (as_json) {
                json_t *jr = json_pack("{s:i, s:b, s:f, s:s}", "rank", r, "ok", 0, "plan_ms", ms, "error", e.msg);
                json_object_set_new(jr, "problems", report ? lines_json(report) : json_pack("[s]", e.msg));
                json_array_append_new(ranks, jr);
            } else {
                printf("rank %d/%d: NOT loadable (%s), planned in %.1f ms\n", r, ws, err_str(rc), ms);
                if (report) {
                    const char *p = report;
                    while (*p) {
                        const char *nl = strchr(p, '\n');
                        size_t n = nl ? (size_t) (nl - p) : strlen(p);
                        printf("  problem: %.*s\n", (int) n, p);
                        p += n + (nl ? 1 : 0);
                    }
                } else {
                    printf("  problem: %s\n", e.msg);
                }
            }
            free(report);
            continue;
        }
        {
            struct ckpt_plan_stats st;
            /* a worker serves this plan; --strict wants the speculation asked for, too */
            bool short_mtp = ckpt_mtp_depth(c) < K;

            if (strict && short_mtp)
                bad = 1;
            ckpt_plan_stats(c, &st);
            if (as_json) {
                json_t *jr = json_pack("{s:i, s:b, s:I, s:I, s:i, s:i, s:i, s:f, s:f}", "rank", r, "ok", 1,
                                       "tensors", (json_int_t) st.n_tensors, "bytes", (json_int_t) st.bytes,
                                       "expert_first", st.expert_first, "expert_count", st.expert_count,
                                       "mtp_depth", ckpt_mtp_depth(c), "plan_ms", ms, "plan_cpu_ms", cms);
                json_object_set_new(jr, "vision_tensors", json_integer(st.vision_tensors));
                json_object_set_new(jr, "vision_bytes", json_integer(st.vision_bytes));
                json_object_set_new(jr, "warnings", lines_json(ckpt_warnings(c)));
                json_object_set_new(jr, "speculation", json_boolean(ckpt_mtp_depth(c) > 0));
                if (strict && short_mtp)
                    json_object_set_new(jr, "ok", json_false());
                json_array_append_new(ranks, jr);
            } else {
                const char *w = ckpt_warnings(c);
                printf("rank %d/%d: ok: %lld tensors, %lld bytes (%.2f GiB), experts %d..%d (%d), MTP depth %d, planned in %.1f ms (%.1f ms CPU)\n",
                       r, ws, (long long) st.n_tensors, (long long) st.bytes, (double) st.bytes / (1ull << 30),
                       st.expert_first, st.expert_first + st.expert_count - 1, st.expert_count,
                       ckpt_mtp_depth(c), ms, cms);
                if (st.vision_tensors)
                    printf("  vision tower: %lld tensors, %lld bytes (%.2f GiB), in the weights above\n",
                           (long long) st.vision_tensors, (long long) st.vision_bytes,
                           (double) st.vision_bytes / (1ull << 30));
                while (*w) {
                    const char *nl = strchr(w, '\n');
                    size_t n = nl ? (size_t) (nl - w) : strlen(w);
                    printf("  warning: %.*s\n", (int) n, w);
                    w += n + (nl ? 1 : 0);
                }
                if (short_mtp)
                    printf("  %s: MTP depth %d of the %d requested: a worker serves this plan without%s "
                           "speculation\n", strict ? "NOT loadable as requested (--strict)" : "note",
                           ckpt_mtp_depth(c), K, ckpt_mtp_depth(c) ? " full" : "");
                if (list)
                    ckpt_plan_dump(c, stdout);
            }
            if (mp.on) {
                json_t *jr = as_json ? json_array_get(ranks, json_array_size(ranks) - 1) : NULL;
                nofit |= memory_plan(&mp, c, ws, r, jr);
            }
        }
        ckpt_close(c);
    }
    if (mp.on && only_rank < 0 && !bad && !nofit && !as_json)
        printf("group: full-attention pool %d blocks = %lld tokens, sliding-window pool %d blocks "
               "(the smallest over the ranks): %lld sequences of %d tokens at once\n", mp.group_full,
               (long long) mp.group_full * mp.block_size, mp.group_sliding,
               (long long) (mp.group_full / mp.seq_blocks), mp.max_model_len);
    if (as_json) {
        json_object_set_new(out, "ok", json_boolean(!bad && !nofit));
        if (mp.on)
            json_object_set_new(out, "memory_fits", json_boolean(!nofit));
        json_dumpf(out, stdout, JSON_INDENT(2));
        putchar('\n');
        json_decref(out);
    } else {
        printf("%s\n", bad ? "NOT loadable" : nofit ? "loadable; the KV cache does NOT fit" : "loadable");
    }
    return bad || nofit;
}
