/* inspect.c - stepd-inspect: validate a checkpoint and print its load plan
 * without reading tensor data.
 *
 *   stepd-inspect MODEL_DIR [--world-size N] [--rank R] [--mtp K] [--mtp-model DIR]
 *                 [--json] [--list] [--strict]
 *
 * For every rank (or the one given) it runs the loader in headers-only mode and
 * prints tensors, bytes, experts held, the MTP depth actually planned, the planning
 * time, every warning and every problem.  Exit status: 0 when every inspected rank
 * is loadable, 1 when some rank is not, 2 on a usage error.  --mtp defaults to all
 * MTP layers the config declares.  MTP layers that are incomplete are what a worker
 * makes of them: every missing name is listed, the plan is the trunk's (served without
 * speculation) and the exit status 0 - unless --strict, which fails a plan whose MTP
 * depth is below the one requested.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "clock.h"
#include "cli.h"
#include "config.h"
#include "loader.h"
#include "stepd-config.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: stepd-inspect MODEL_DIR [--world-size N] [--rank R] [--mtp K] [--mtp-model DIR] [--json] [--list]\n"
               "                     [--strict]\n");
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
        { "list", no_argument, NULL, 'l' },
        { "strict", no_argument, NULL, 's' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, 'V' },
        { 0 },
    };
    int ws = 1, only_rank = -1, K = -1, opt, bad = 0;
    bool as_json = false, list = false, strict = false;
    const char *mtp_dir = NULL, *dir;
    json_t *out = NULL, *ranks = NULL;

    while ((opt = getopt_long(argc, argv, "n:r:k:m:jlshV", longopts, NULL)) != -1) {
        switch (opt) {
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
    if (as_json) {
        out = json_pack("{s:s, s:i, s:i, s:s?}", "model_dir", dir, "world_size", ws, "mtp_requested", K,
                        "mtp_model", mtp_dir);
        ranks = json_array();
        json_object_set_new(out, "ranks", ranks);
    } else {
        printf("%s: world size %d, MTP depth requested %d%s%s\n", dir, ws, K, mtp_dir ? ", --mtp-model " : "",
               mtp_dir ? mtp_dir : "");
    }
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
        t0 = now_ms();
        c0 = cpu_ms();
        rc = ckpt_open(dir, &o, &c, &e);
        ms = now_ms() - t0;
        cms = cpu_ms() - c0;
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
        }
        ckpt_close(c);
    }
    if (as_json) {
        json_object_set_new(out, "ok", json_boolean(!bad));
        json_dumpf(out, stdout, JSON_INDENT(2));
        putchar('\n');
        json_decref(out);
    } else {
        printf("%s\n", bad ? "NOT loadable" : "loadable");
    }
    return bad;
}
