/* dryrun.c - full-scale dry run of the loader on the real Step-3.7-Flash-MXFP4 layout.
 *
 *   stepd-dryrun EXPECTED_TSV [--keep DIR] [--shards N] [--inspect STEPD_INSPECT]
 *
 * Reads the expected tensor list (test/data/step37-mxfp4-expected-tensors.tsv, read by
 * ckptw_tsv_read: "{0..287}" ranges expanded, "F32?" read as F32), writes safetensors
 * headers with those names/dtypes/shapes over SPARSE data
 * regions (ftruncate, no disk used) split into shards plus the index and a real
 * Step-3.7 nested config.json with the compressed-tensors quantization_config, then
 * plans N=1 and N=8 (every rank) with MTP K=3 in headers-only mode and once with
 * the shards mapped.  Prints per-rank tensors, bytes, experts and planning time.
 * The MTP layers of that layout have no KV scales or zero points: they must plan.
 * With --inspect, stepd-inspect's memory plan of that layout on 141 GB devices
 * (--gpu-memory-utilization 0.9, --max-model-len 262144, 8 sequences, BF16 KV) at N = 1,
 * 2, 4, 8, printed: one full-length sequence does not fit beside the 119 GB of weights on
 * one device (the plan names the longest --max-model-len that does), it fits from N = 2 on,
 * and N = 8 holds dozens of them on every rank.
 * The TSV ships in the repository (test/data/); a missing one is a failure.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "ckptw.h"
#include "harness.h"
#include "loader.h"

static struct ckptw_tsv_row *rows;
static size_t n_rows;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

/* CPU time of this thread: the planning cost without other processes' load */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

static bool is_vision(const char *n)
{
    return strncmp(n, "vision_model.", 13) == 0 || strncmp(n, "vit_large_projector", 19) == 0;
}

int main(int argc, char **argv)
{
    const char *tsv = argc > 1 ? argv[1] : NULL, *keep = NULL, *inspect = NULL;
    int n_shards = 12;
    char *dir, path[PATH_MAX];
    struct model_config cfg;
    struct err_buf e = { "" };
    json_t *idx, *wm;
    int64_t text_bytes = 0, text_tensors = 0, sparse_blocks = 0, vis_bytes = 0, vis_tensors = 0;
    double t0;

    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--keep") == 0 && i + 1 < argc)
            keep = argv[++i];
        else if (strcmp(argv[i], "--shards") == 0 && i + 1 < argc)
            n_shards = atoi(argv[++i]);
        else if (strcmp(argv[i], "--inspect") == 0 && i + 1 < argc)
            inspect = argv[++i];
    }
    if (!tsv)
        FAIL("usage: stepd-dryrun EXPECTED_TSV [--keep DIR] [--shards N]");
    if (ckptw_tsv_read(tsv, &rows, &n_rows, &e) < 0)
        FAIL("%s", e.msg);
    for (size_t i = 0; i < n_rows; i++)
        if (!is_vision(rows[i].name)) {
            text_tensors++;
            text_bytes += ckptw_tensor_bytes(rows[i].dtype, rows[i].ndim, rows[i].shape);
        } else {
            vis_tensors++;
            vis_bytes += ckptw_tensor_bytes(rows[i].dtype, rows[i].ndim, rows[i].shape);
        }
    printf("layout: %zu tensors (%lld text, %.1f GB text)\n", n_rows, (long long) text_tensors, (double) text_bytes / 1e9);
    ASSERT_EQ(text_tensors, 73254);

    if (keep) {
        dir = strdup(keep);
        mkdir(dir, 0755);
    } else {
        dir = ckptw_tmpdir("stepd-dryrun");
    }
    ASSERT_TRUE(dir != NULL);
    t0 = now_ms();
    ckptw_config_step37(&cfg);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    ASSERT_OK(ckptw_write_config(path, &cfg, true, false, &e));
    {
        /* the tower as vLLM's PerceptionEncoder reads it: the loader's expected vision list
         * must be exactly the TSV's 667 vision rows */
        json_error_t je;
        json_t *c = json_load_file(path, 0, &je);
        ASSERT_TRUE(c != NULL);
        json_object_set_new(c, "vision_config", json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:b, s:b}",
            "model_type", "perception_encoder", "width", 1536, "layers", 47, "heads", 16, "patch_size", 14,
            "image_size", 728, "mlp_ratio", 8960.0 / 1536.0, "hidden_act", "quick_gelu", "use_cls_token", 0,
            "use_ln_post", 0));
        json_object_set_new(c, "projector_bias", json_false());
        ASSERT_OK(json_dump_file(c, path, JSON_INDENT(1)));
        json_decref(c);
    }
    idx = json_object();
    wm = json_object();
    json_object_set_new(idx, "weight_map", wm);
    json_object_set_new(idx, "metadata", json_pack("{s:I}", "total_size", (json_int_t) 1));   /* stale, as qstream */
    for (int s = 0; s < n_shards; s++) {
        size_t a = n_rows * (size_t) s / (size_t) n_shards, b = n_rows * (size_t) (s + 1) / (size_t) n_shards;
        struct ckptw_tensor *ts = calloc(b - a + 1, sizeof(*ts));
        char fname[64];
        struct stat st;
        snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        for (size_t i = a; i < b; i++) {
            ts[i - a] = (struct ckptw_tensor) { .name = rows[i].name, .dtype = rows[i].dtype, .ndim = rows[i].ndim };
            memcpy(ts[i - a].shape, rows[i].shape, sizeof(ts[i - a].shape));
            json_object_set_new(wm, rows[i].name, json_string(fname));
        }
        snprintf(path, sizeof(path), "%s/%s", dir, fname);
        if (ckptw_write_safetensors(path, ts, b - a, true, &e) < 0)
            FAIL("%s", e.msg);
        ASSERT_OK(stat(path, &st));
        sparse_blocks += st.st_blocks;
        free(ts);
    }
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    ASSERT_OK(json_dump_file(idx, path, JSON_COMPACT));
    json_decref(idx);
    printf("wrote %d sparse shards + index + config in %.0f ms; disk used by shards %.1f MB\n", n_shards,
           now_ms() - t0, (double) sparse_blocks * 512 / 1e6);

    {
        static const int sizes[2] = { 1, 8 };
        for (int k = 0; k < 2; k++) {
            int ws = sizes[k];
            int64_t sum_bytes = 0, experts = 0;
            for (int r = 0; r < ws; r++) {
                struct ckpt_opts o = { .world_size = ws, .rank = r, .mtp_depth = 3, .headers_only = true };
                struct ckpt_plan_stats st;
                struct ckpt *c;
                double ms, cms, c0;
                t0 = now_ms();
                c0 = cpu_ms();
                if (ckpt_open(dir, &o, &c, &e) < 0)
                    FAIL("N=%d rank %d: %s", ws, r, e.msg);
                ms = now_ms() - t0;
                cms = cpu_ms() - c0;
                ckpt_plan_stats(c, &st);
                printf("N=%d rank %d: %lld tensors, %lld bytes (%.2f GB), experts %d..%d, MTP depth %d, planned in %.1f ms (%.1f ms CPU)\n",
                       ws, r, (long long) st.n_tensors, (long long) st.bytes, (double) st.bytes / 1e9, st.expert_first,
                       st.expert_first + st.expert_count - 1, ckpt_mtp_depth(c), ms, cms);
                ASSERT_EQ(ckpt_mtp_depth(c), 3);
                ASSERT_EQ(st.expert_count, 288 / ws);
                /* the vision tower: whole, on rank 0 only */
                ASSERT_TRUE(strstr(ckpt_warnings(c), "vision") == NULL);
                ASSERT_EQ(st.vision_tensors, r == 0 ? vis_tensors : 0);
                ASSERT_EQ(st.vision_bytes, r == 0 ? vis_bytes : 0);
                if (ws == 1) {
                    ASSERT_EQ(vis_tensors, 667);
                    ASSERT_EQ(st.n_tensors, text_tensors + vis_tensors);
                    ASSERT_EQ(st.bytes, text_bytes + vis_bytes);
                }
                sum_bytes += st.bytes;
                experts += st.expert_count;
                ckpt_close(c);
            }
            ASSERT_EQ(experts, 288);
            printf("N=%d: %.2f GB over all ranks\n", ws, (double) sum_bytes / 1e9);
        }
    }
    /* and once with the (sparse) shards mapped: views point into the mapping */
    {
        struct ckpt_opts o = { .world_size = 8, .rank = 0, .mtp_depth = 3 };
        struct ckpt *c;
        struct tview v;
        t0 = now_ms();
        if (ckpt_open(dir, &o, &c, &e) < 0)
            FAIL("mapped: %s", e.msg);
        printf("N=8 rank 0 with shards mapped: opened in %.1f ms\n", now_ms() - t0);
        ASSERT_OK(ckpt_get(c, "model.layers.47.transformer.shared_head.output.weight", &v));
        ASSERT_EQ(v.shape[0], 128896);
        ASSERT_OK(ckpt_get(c, "model.layers.4.self_attn.q_proj.weight", &v));
        ASSERT_EQ(v.shape[0], 8 * 128);
        ASSERT_OK(ckpt_get(c, "model.layers.44.moe.experts.35.down_proj.weight_packed", &v));
        ASSERT_EQ(v.nbytes, 4096 * 640);
        ASSERT_ERR(ckpt_get(c, "model.layers.44.moe.experts.36.down_proj.weight_packed", &v), -ENOENT);
        ckpt_close(c);
    }
    if (inspect) {
        static const int sizes[4] = { 1, 2, 4, 8 };
        for (int k = 0; k < 4; k++) {
            char cmd[PATH_MAX * 2 + 200], line[1024];
            int fits = 0, nofit = 0, seqs = -1, vis = 0;
            snprintf(cmd, sizeof(cmd), "'%s' '%s' --world-size %d --device-memory 141G "
                     "--max-model-len 262144 2>&1", inspect, dir, sizes[k]);
            FILE *p = popen(cmd, "r");
            ASSERT_TRUE(p != NULL);
            while (fgets(line, sizeof(line), p)) {
                if (strstr(line, "warning:"))
                    continue;
                fputs(line, stdout);
                fits += strstr(line, "  fits: ") != NULL;
                nofit += strncmp(line, "  does NOT fit", 14) == 0;
                vis += strncmp(line, "  vision tower: 667 tensors", 27) == 0;
                if (strncmp(line, "group: ", 7) == 0)
                    ASSERT_TRUE(sscanf(strstr(line, "): ") + 3, "%d sequences", &seqs) == 1);
            }
            int st = pclose(p);
            ASSERT_EQ(vis, 1);      /* rank 0 holds the tower */
            if (sizes[k] == 1) {
                ASSERT_EQ(nofit, 1);
                ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
            } else {
                ASSERT_EQ(fits, sizes[k]);
                ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
                ASSERT_TRUE(seqs >= (sizes[k] == 8 ? 32 : 1));
            }
        }
    }
    if (!keep)
        ckptw_rmtree(dir);
    free(dir);
    ckptw_tsv_free(rows, n_rows);
    return 0;
}
