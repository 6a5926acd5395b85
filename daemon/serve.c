/* serve.c - `stepd serve`: the coordinator's own worker ranks, started and supervised with
 * libuv child processes (see serve.h).
 *
 * Owns the ranks' process handles, their restart timers, the private runtime directory
 * (control key file, engine sockets) and the start-up log of the model (MTP, load plan
 * per rank).  Invariant: a rank is started only while the coordinator is not stopping and
 * its group is not given up; once serve_shutdown() ran nothing is started again, and the
 * serve's handles are closed when the last rank has exited (which is what lets the loop,
 * and so the process, end).
 */
#include "serve.h"

#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <inttypes.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "config.h"
#include "kvplan.h"
#include "specconf.h"
#include "coord-int.h"
#include "err.h"
#include "loader.h"
#include "log.h"
#include "notify.h"
#include "strbuf.h"

#define SERVE_MAX_GROUPS 64
#define SERVE_MAX_ARGS 64
#define SERVE_TICK_MS 1000

extern char **environ;

struct serve;

struct srank {
    struct serve *s;
    struct sgroup *g;
    unsigned rank;
    uv_process_t *proc;             /* while running (freed by its close callback) */
    int pid;
    bool running;
    bool term_sent;
    unsigned failures;              /* in a row, since the group was last ready */
    uint64_t restarts;
    int64_t started_ms;
    int64_t restart_at_ms;          /* 0 unless a restart is scheduled */
    uv_timer_t t_restart;
    char last_exit[128];            /* "exited with status 1 (failure)" */
    char message[256];              /* for GetGroups */
};

struct sgroup {
    char name[16];
    struct group *wg;               /* the coordinator's view (wpool) */
    struct srank ranks[COORD_MAX_WORLD];
    bool given_up;
    bool ever_ready;
    char reason[256];
};

struct serve {
    struct serve_opts o;
    struct coord *co;
    char model_dir[PATH_MAX];
    char worker_bin[PATH_MAX];
    char rundir[PATH_MAX - 128];
    char key_file[PATH_MAX + 16];
    char ctl_addr[300];
    char *worker_args;              /* NUL-separated, n_wargs of them */
    size_t n_wargs;
    unsigned n_groups, world, threads;
    struct spec_config spec;        /* --speculative-config, parsed as the ranks parse it */
    int spec_k;                     /* the drafts per step rank 0 will make (0: none) */
    bool pass_gpu_mem;              /* this stepd-worker knows --gpu-memory-utilization */
    struct sgroup groups[SERVE_MAX_GROUPS];
    uv_timer_t t_tick, t_stop;
    bool timers_on, stopping, closed, startup_logged, ready_sent, in_check;
    int stop_stage;
    int64_t start_ms, spec_last_ms;
    uint64_t spec_drafts, spec_tokens, spec_accepted, spec_pos[METRICS_MAX_POS];
};

/* A rank's command line: argv (NULL-ended, n entries; room for 2 more) pointing into a. */
struct rank_argv {
    char a[SERVE_MAX_ARGS][PATH_MAX + 32];
    char *argv[SERVE_MAX_ARGS + 3];
    int n;
};

static void rank_start(struct srank *rk);
static void rank_argv(const struct serve *s, unsigned group, unsigned rank, struct rank_argv *ra);

void serve_opts_default(struct serve_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->tensor_parallel = 1;
    o->data_parallel = 1;
    o->device = "cpu";
    o->restart_limit = 5;
    o->backoff_ms = 500;
    o->backoff_max_ms = 30000;
    o->worker_stop_timeout_ms = 15000;
    o->spec_log_interval_ms = 10000;
    o->prefix_caching = -1;
}

/* ------------------------------------------------------------------ preparation */

/* --kv-cache-memory against what rank `rank` needs for one sequence of --max-model-len (the
 * rank's own plan, kvplan.h, as the worker makes it). */
static int check_kv_budget(const struct serve *s, const struct ckpt *ck, unsigned rank, struct err_buf *e)
{
    const struct serve_opts *o = &s->o;
    const struct model_config *mc = ckpt_config(ck);
    int depth = ckpt_mtp_depth(ck);
    int bs = o->block_size ? (int)o->block_size : KVPLAN_DEFAULT_BLOCK_SIZE;
    struct kvplan_req q = {
        .block_size = bs,
        .max_num_seqs = o->max_num_seqs ? (int)o->max_num_seqs : KVPLAN_DEFAULT_MAX_SEQS,
        .max_model_len = o->max_model_len ? (int)o->max_model_len : KVPLAN_DEFAULT_MAX_MODEL_LEN,
        .max_batched_tokens = o->max_num_batched_tokens ? (int)o->max_num_batched_tokens
                                                        : KVPLAN_DEFAULT_MAX_BATCHED_TOKENS,
        .sliding_window = mc->sliding_window,
        .mtp_margin = depth < KVPLAN_MAX_DRAFTS ? depth : KVPLAN_MAX_DRAFTS,
    };
    int64_t bpt[_KVPLAN_POOLS];
    struct kvplan p;
    int r;

    if (o->kv_cache_memory <= 0)
        return 0;
    kvplan_bytes_per_token(mc, (int)s->world, (int)rank, depth,
                           o->kv_cache_dtype && strcmp(o->kv_cache_dtype, "fp32") == 0 ? 4 : 2, bpt);
    for (int g = 0; g < _KVPLAN_POOLS; g++)
        q.bytes_per_token[g] = bpt[g];
    r = kvplan_compute(&q, o->kv_cache_memory, &p, e);
    if (r < 0)
        err_prefix(e, "--kv-cache-memory (rank %u)", rank);
    return r;
}

/* The model and every rank's load plan, as the ranks will see them (headers only), and
 * what a rank would refuse in them: --max-model-len, --quantization, the KV budget. */
static int log_model(struct serve *s)
{
    struct err_buf e = { "" };
    int r = 0;
    bool spec_on = s->o.speculative_config != NULL;

    struct model_config declared;
    char cfg_path[PATH_MAX + 16];

    snprintf(cfg_path, sizeof(cfg_path), "%s/config.json", s->model_dir);
    if ((r = model_config_load(cfg_path, &declared, &e)) < 0) {
        log_error("%s", e.msg);
        return r;
    }
    for (unsigned rank = 0; rank < s->world; rank++) {
        struct ckpt_opts co = { .world_size = (int)s->world, .rank = (int)rank,
                                .mtp_dir = spec_on && s->spec.model[0] ? s->spec.model : NULL,
                                .mtp_depth = rank == 0 && spec_on ? spec_config_depth(&s->spec, declared.n_mtp_layers)
                                                                  : 0,
                                .headers_only = true };
        struct ckpt *ck = NULL;
        struct ckpt_plan_stats ps;

        r = ckpt_open(s->model_dir, &co, &ck, &e);
        if (r < 0) {
            log_error("%s cannot be loaded with --tensor-parallel-size %u (rank %u): %s", s->model_dir,
                      s->world, rank, e.msg);
            return r;
        }
        if (rank == 0) {
            const struct model_config *mc = ckpt_config(ck);
            int depth = ckpt_mtp_depth(ck);

            s->spec_k = spec_on ? spec_config_k(&s->spec, depth) : 0;
            if (spec_on && s->spec.num_speculative_tokens > s->spec_k)
                log_warn("--speculative-config: num_speculative_tokens %d, but the checkpoint has %d usable MTP "
                         "layer%s: speculating %d token%s per step", s->spec.num_speculative_tokens, depth,
                         depth == 1 ? "" : "s", s->spec_k, s->spec_k == 1 ? "" : "s");
            r = model_config_check_len(mc, s->o.max_model_len ? (int)s->o.max_model_len
                                                              : KVPLAN_DEFAULT_MAX_MODEL_LEN,
                                       s->o.allow_long_max_model_len, &e);
            if (r == 0 && spec_on && s->spec.draft_vocab > mc->vocab_size)
                r = err_set(&e, -EINVAL, "--speculative-config: draft_vocab: %d is above the model's vocabulary "
                            "(%d tokens)", s->spec.draft_vocab, mc->vocab_size);
            if (r == 0 && s->o.quantization && mc->quant != QUANT_MXFP4)
                r = err_set(&e, -EINVAL, "--quantization %s: %s holds BF16 routed experts, not MXFP4 (serve it "
                            "without --quantization)", s->o.quantization, s->model_dir);
            if (r < 0) {
                log_error("%s", e.msg);
                ckpt_close(ck);
                return r;
            }

            log_info("model %s: %s, %d layers, hidden %d, %d experts (top %d), vocabulary %d, %s", s->model_dir,
                     mc->model_type, mc->n_layers, mc->hidden_size, mc->n_experts, mc->top_k, mc->vocab_size,
                     mc->quant == QUANT_MXFP4 ? "MXFP4 routed experts" : "BF16");
            if (mc->n_mtp_layers > 0 && s->spec_k > 0 && depth > 0) {
                log_info("MTP detected: %d draft layer%s in the checkpoint (num_nextn_predict_layers); "
                         "speculating %d token%s per step; the drafts share the target's embedding "
                         "(model.embed_tokens.weight) and use their own heads (shared_head)",
                         mc->n_mtp_layers, mc->n_mtp_layers == 1 ? "" : "s", s->spec_k,
                         s->spec_k == 1 ? "" : "s");
                log_info("Detected MTP model. Sharing target model embedding weights with the draft model "
                         "(%d MTP layer%s, method mtp, num_speculative_tokens %d)", depth, depth == 1 ? "" : "s",
                         s->spec_k);
            } else if (mc->n_mtp_layers > 0)
                log_info("MTP detected: %d draft layer%s in the checkpoint, not used (enable with "
                         "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":%d}')",
                         mc->n_mtp_layers, mc->n_mtp_layers == 1 ? "" : "s",
                         mc->n_mtp_layers < 3 ? mc->n_mtp_layers : 3);
            else if (spec_on && s->spec.num_speculative_tokens != 0)
                log_warn("--speculative-config asks for MTP drafts, but the checkpoint has no MTP layers: "
                         "no speculation");
            const char *w = ckpt_warnings(ck);
            if (w && *w)
                log_warn("checkpoint: %s", w);
        }
        if ((r = check_kv_budget(s, ck, rank, &e)) < 0) {
            log_error("%s", e.msg);
            ckpt_close(ck);
            return r;
        }
        ckpt_plan_stats(ck, &ps);
        log_info("load plan rank %u of %u: %" PRId64 " tensors, %.1f MiB, experts [%d, %d)%s", rank, s->world,
                 ps.n_tensors, (double)ps.bytes / (1024.0 * 1024.0), ps.expert_first,
                 ps.expert_first + ps.expert_count, rank == 0 && s->spec_k > 0 ? ", MTP layers" : "");
        ckpt_close(ck);
    }
    return r;
}

static int find_worker(struct serve *s)
{
    char self[PATH_MAX - 64];
    ssize_t n;

    if (s->o.worker_binary) {
        if (access(s->o.worker_binary, X_OK) < 0) {
            log_error("--worker-binary %s: %s", s->o.worker_binary, strerror(errno));
            return -errno;
        }
        snprintf(s->worker_bin, sizeof(s->worker_bin), "%s", s->o.worker_binary);
        return 0;
    }
    n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash) {
            *slash = '\0';
            /* installed side by side, or the build tree (build/daemon/stepd, build/worker/) */
            const char *cands[] = { "%s/stepd-worker", "%s/../worker/stepd-worker" };
            for (size_t i = 0; i < ARRAY_SIZE(cands); i++) {
                snprintf(s->worker_bin, sizeof(s->worker_bin), cands[i], self);
                if (access(s->worker_bin, X_OK) == 0)
                    return 0;
            }
        }
    }
    snprintf(s->worker_bin, sizeof(s->worker_bin), "stepd-worker");   /* $PATH */
    return 0;
}

/* Does this stepd-worker take `flag`?  Asked once, from its --help. */
static bool worker_has_flag(const struct serve *s, const char *flag)
{
    char cmd[PATH_MAX + 32], line[512];
    bool found = false;
    FILE *p;

    if (strchr(s->worker_bin, '\''))
        return false;
    snprintf(cmd, sizeof(cmd), "'%s' --help 2>/dev/null", s->worker_bin);
    p = popen(cmd, "r");
    if (!p)
        return false;
    while (fgets(line, sizeof(line), p))
        found |= strstr(line, flag) != NULL;
    pclose(p);
    return found;
}

/* Run `argv` (stepd-worker ... --check-device DEV) and read what it says into out: its exit
 * status, or -errno when it cannot run. */
static int run_capture(char *const argv[], char *out, size_t n)
{
    int fd[2], st;
    size_t off = 0;
    ssize_t got;
    pid_t pid;

    out[0] = '\0';
    if (pipe2(fd, O_CLOEXEC) < 0)
        return -errno;
    pid = fork();
    if (pid < 0) {
        close(fd[0]);
        close(fd[1]);
        return -errno;
    }
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        execv(argv[0], argv);
        execvp(argv[0], argv);          /* "stepd-worker" from $PATH */
        _exit(127);
    }
    close(fd[1]);
    while (off + 1 < n && (got = read(fd[0], out + off, n - 1 - off)) > 0)
        off += (size_t)got;
    out[off] = '\0';
    char rest[256];
    while (read(fd[0], rest, sizeof(rest)) > 0)
        ;                               /* drain the rest */
    close(fd[0]);
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -errno;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Every rank's command line as the worker itself parses it (its flags, the speculative
 * config, --worker-arg flags: `--check-device DEV` last answers once all before it were
 * taken), and on --device cuda every rank's device: what would make a rank exit 2, or fail
 * on every start, ends `stepd serve` now with the worker's own reason. */
static int check_ranks(const struct serve *s)
{
    bool cuda = strcmp(s->o.device, "cuda") == 0;
    unsigned n = cuda ? s->n_groups * s->world : 1;
    struct rank_argv *ra = malloc(sizeof(*ra));
    char out[1024], dev[32];
    int r = 0;

    if (!ra)
        return -ENOMEM;
    for (unsigned i = 0; i < n && r == 0; i++) {
        int st;

        rank_argv(s, i / s->world, i % s->world, ra);
        snprintf(dev, sizeof(dev), cuda ? "cuda:%u" : "cpu", i);
        ra->argv[ra->n] = "--check-device";
        ra->argv[ra->n + 1] = dev;
        ra->argv[ra->n + 2] = NULL;
        st = run_capture(ra->argv, out, sizeof(out));
        if (st == 0)
            continue;
        /* the worker's first line that is not a log line says why ("stepd-worker: ..." or
         * getopt's "PATH: unrecognized option ...", before its usage) */
        char *last = out;
        while (last[0] == '<' && last[1] >= '0' && last[1] <= '7' && last[2] == '>' && strchr(last, '\n'))
            last = strchr(last, '\n') + 1;
        last[strcspn(last, "\n")] = '\0';
        size_t bl = strlen(s->worker_bin);
        if (strncmp(last, "stepd-worker: ", 14) == 0)
            last += 14;
        else if (strncmp(last, s->worker_bin, bl) == 0 && strncmp(last + bl, ": ", 2) == 0)
            last += bl + 2;
        if (st < 0)
            log_error("cannot run %s: %s", s->worker_bin, strerror(-st));
        else if (strncmp(last, "usage:", 6) == 0 || !last[0])
            log_error("%s refuses the ranks' flags (exit %d); see %s --help", s->worker_bin, st, s->worker_bin);
        else if (cuda && strncmp(last, dev, strlen(dev)) == 0)
            log_error("--device cuda: rank %u of %u needs %s (%s --check-device)", i, n, last, s->worker_bin);
        else
            log_error("a rank would refuse its flags: %s", last);
        r = st < 0 ? st : cuda && strncmp(last, dev, strlen(dev)) == 0 ? -ENODEV : -EINVAL;
    }
    free(ra);
    return r;
}

static int make_rundir(struct serve *s)
{
    const char *base = getenv("RUNTIME_DIRECTORY");     /* systemd RuntimeDirectory= */
    char first[PATH_MAX];

    if (!base || !*base)
        base = getenv("XDG_RUNTIME_DIR");
    if (!base || !*base)
        base = getenv("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    snprintf(first, sizeof(first), "%s", base);
    char *colon = strchr(first, ':');               /* several RuntimeDirectory= entries */
    if (colon)
        *colon = '\0';
    if (snprintf(s->rundir, sizeof(s->rundir), "%s/stepd-serve.XXXXXX", first) >= (int)sizeof(s->rundir) - 64) {
        log_error("runtime directory base %s: path too long", first);
        return -ENAMETOOLONG;
    }
    /* the engines' unix sockets live here: sockaddr_un holds 107 bytes of path */
    if (strlen(s->rundir) + sizeof("/engine-g63.sock") > 107) {
        log_error("runtime directory %s: too long a path for the engines' unix sockets "
                  "(set $RUNTIME_DIRECTORY or $TMPDIR to a shorter one)", s->rundir);
        s->rundir[0] = '\0';
        return -ENAMETOOLONG;
    }
    if (!mkdtemp(s->rundir)) {              /* mode 0700 */
        int r = -errno;
        log_error("cannot create a runtime directory under %s: %s", first, strerror(errno));
        s->rundir[0] = '\0';
        return r;
    }
    return 0;
}

/* The per-run control key: 32 random bytes in hex, in a 0600 file only the ranks read. */
static int write_key(struct serve *s, const char *given, char **ret_key)
{
    unsigned char raw[32];
    char hex[65];
    const char *key = given;
    int fd, r = 0;

    if (!key || !*key) {
        if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw)) {
            log_error("getrandom: %s", strerror(errno));
            return -EIO;
        }
        for (size_t i = 0; i < sizeof(raw); i++)
            snprintf(hex + 2 * i, 3, "%02x", raw[i]);
        key = hex;
    }
    snprintf(s->key_file, sizeof(s->key_file), "%s/control-key", s->rundir);
    fd = open(s->key_file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        r = -errno;
        log_error("%s: %s", s->key_file, strerror(errno));
        goto out;
    }
    size_t len = strlen(key);
    if (write(fd, key, len) != (ssize_t)len || write(fd, "\n", 1) != 1) {
        r = -EIO;
        log_error("%s: cannot write the control key", s->key_file);
    }
    close(fd);
    if (r == 0 && !(*ret_key = strdup(key)))
        r = -ENOMEM;
out:
    memset(raw, 0, sizeof(raw));
    memset(hex, 0, sizeof(hex));
    return r;
}

static unsigned cpus_allowed(void)
{
    cpu_set_t set;

    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        return (unsigned)CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (unsigned)n : 1;
}

int serve_prepare(const struct serve_opts *o, const char *ctl_key, struct serve **ret, char **ret_key)
{
    struct serve *s;
    int r;

    if (o->tensor_parallel != 1 && o->tensor_parallel != 2 && o->tensor_parallel != 4 &&
        o->tensor_parallel != 8) {
        log_error("--tensor-parallel-size %u: must be 1, 2, 4 or 8", o->tensor_parallel);
        return -EINVAL;
    }
    if (o->data_parallel < 1 || o->data_parallel > SERVE_MAX_GROUPS) {
        log_error("--data-parallel-size %u: must be 1..%d", o->data_parallel, SERVE_MAX_GROUPS);
        return -EINVAL;
    }
    if (strcmp(o->device, "cpu") != 0 && strcmp(o->device, "cuda") != 0) {
        log_error("--device '%s': expected cpu or cuda", o->device);
        return -EINVAL;
    }
    if (o->gpu_memory_utilization < 0 || o->gpu_memory_utilization > 1) {
        log_error("--gpu-memory-utilization %g: must be in (0, 1]", o->gpu_memory_utilization);
        return -EINVAL;
    }
    if (o->restart_limit < 1 || o->backoff_ms < 1 || o->backoff_max_ms < o->backoff_ms) {
        log_error("--worker-restart-limit must be at least 1, and --worker-backoff-max-ms at least "
                  "--worker-backoff-ms (at least 1)");
        return -EINVAL;
    }
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->o = *o;
    s->world = o->tensor_parallel;
    s->n_groups = o->data_parallel;
    if (!realpath(o->model_dir, s->model_dir)) {
        r = -errno;
        log_error("model directory %s: %s", o->model_dir, strerror(errno));
        goto fail;
    }
    if (o->speculative_config) {
        struct err_buf e;

        if ((r = spec_config_parse(o->speculative_config, &s->spec, &e)) < 0) {
            log_error("%s", e.msg);
            goto fail;
        }
    }
    if ((r = log_model(s)) < 0)
        goto fail;
    if ((r = find_worker(s)) < 0)
        goto fail;
    if (o->gpu_memory_utilization > 0) {
        s->pass_gpu_mem = worker_has_flag(s, "--gpu-memory-utilization");
        if (!s->pass_gpu_mem)
            log_warn("--gpu-memory-utilization %g: %s has no such flag; the KV cache is sized by "
                     "--max-num-seqs and --max-model-len", o->gpu_memory_utilization, s->worker_bin);
    }
    /* the worker args, copied: they outlive argv only by convention */
    struct strbuf wa = STRBUF_INIT;
    for (size_t i = 0; i < o->n_worker_args; i++)
        strbuf_add(&wa, o->worker_args[i], strlen(o->worker_args[i]) + 1);
    if (o->n_worker_args && !(s->worker_args = strbuf_take(&wa))) {
        r = -ENOMEM;
        goto fail;
    }
    strbuf_done(&wa);
    s->n_wargs = o->n_worker_args;
    s->o.worker_args = NULL;
    s->threads = o->threads;
    if (!s->threads && strcmp(o->device, "cpu") == 0) {
        unsigned n = cpus_allowed() / (s->world * s->n_groups);
        s->threads = n ? n : 1;
    }
    if ((r = check_ranks(s)) < 0 || (r = make_rundir(s)) < 0 || (r = write_key(s, ctl_key, ret_key)) < 0)
        goto fail;
    *ret = s;
    return 0;
fail:
    serve_free(s);
    return r;
}

/* ------------------------------------------------------------------ ranks */

static const char *exit_name(int64_t st)
{
    switch (st) {
    case 0: return "ok";
    case 1: return "failure";
    case 2: return "usage: bad flags or sizes";
    case 3: return "rendezvous failed or session lost";
    case 4: return "a collective failed";
    }
    return "unknown";
}

static void group_update_coord(struct sgroup *g)
{
    struct group *wg = g->wg;
    bool any = false;

    if (!wg || !g->given_up)
        return;
    for (unsigned i = 0; i < wg->world; i++)
        any |= wg->ranks[i].present;
    if (!any) {
        wg->state = GROUP_FAILED;
        snprintf(wg->last_error, sizeof(wg->last_error), "%s", g->reason);
    }
}

static void rank_signal(struct srank *rk, int sig)
{
    if (rk->running && rk->proc) {
        if (uv_process_kill(rk->proc, sig) == 0 && sig == SIGTERM)
            rk->term_sent = true;
    }
}

static void group_give_up(struct sgroup *g, const char *why)
{
    struct serve *s = g->ranks[0].s;

    if (g->given_up)
        return;
    g->given_up = true;
    snprintf(g->reason, sizeof(g->reason), "not restarted: %s", why);
    log_error("group %s given up: %s; readiness stays NOT_SERVING without it (restart stepd to try again)",
              g->name, why);
    for (unsigned i = 0; i < s->world; i++) {
        struct srank *rk = &g->ranks[i];
        uv_timer_stop(&rk->t_restart);
        rk->restart_at_ms = 0;
        rank_signal(rk, SIGTERM);
        snprintf(rk->message, sizeof(rk->message), "%s", g->reason);
    }
    group_update_coord(g);
    s->co->up->health_changed(s->co);
}

static void maybe_closed(struct serve *s);

static void proc_closed(uv_handle_t *h)
{
    struct srank *rk = h->data;

    free(h);
    if (rk->s->stopping)
        maybe_closed(rk->s);
}

static void restart_cb(uv_timer_t *t)
{
    struct srank *rk = t->data;

    rk->restart_at_ms = 0;
    if (!rk->s->stopping && !rk->g->given_up && !rk->running)
        rank_start(rk);
}

static void on_exit_cb(uv_process_t *p, int64_t status, int term_signal)
{
    struct srank *rk = p->data;
    struct serve *s = rk->s;
    struct sgroup *g = rk->g;
    char what[128];

    rk->running = false;
    rk->proc = NULL;
    p->data = rk;
    uv_close((uv_handle_t *)p, proc_closed);
    if (term_signal)
        snprintf(what, sizeof(what), "killed by signal %d (%s)", term_signal, strsignal(term_signal));
    else
        snprintf(what, sizeof(what), "exited with status %" PRId64 " (%s)", status, exit_name(status));
    snprintf(rk->last_exit, sizeof(rk->last_exit), "%s", what);
    if (s->stopping || g->given_up || rk->term_sent) {
        log_info("group %s rank %u (pid %d) %s", g->name, rk->rank, rk->pid, what);
        snprintf(rk->message, sizeof(rk->message), "%s", g->given_up ? g->reason : what);
        return;
    }
    rk->failures++;
    if (!term_signal && status == 2) {
        char why[256];
        snprintf(why, sizeof(why), "rank %u (pid %d) %s; a restart cannot change that, see its log",
                 rk->rank, rk->pid, what);
        group_give_up(g, why);
        return;
    }
    if (rk->failures >= s->o.restart_limit) {
        char why[256];
        snprintf(why, sizeof(why), "rank %u failed %u time%s in a row (last: pid %d %s)", rk->rank,
                 rk->failures, rk->failures == 1 ? "" : "s", rk->pid, what);
        group_give_up(g, why);
        return;
    }
    uint64_t delay = s->o.backoff_ms;
    for (unsigned i = 1; i < rk->failures && delay < s->o.backoff_max_ms; i++)
        delay *= 2;
    if (delay > s->o.backoff_max_ms)
        delay = s->o.backoff_max_ms;
    log_warn("group %s rank %u (pid %d) %s; restarting in %.1f s (failure %u of %u in a row)", g->name,
             rk->rank, rk->pid, what, (double)delay / 1000.0, rk->failures, s->o.restart_limit);
    snprintf(rk->message, sizeof(rk->message), "%s; restarting in %.1f s (failure %u of %u)", what,
             (double)delay / 1000.0, rk->failures, s->o.restart_limit);
    rk->restart_at_ms = rpc_now_ms() + (int64_t)delay;
    uv_timer_start(&rk->t_restart, restart_cb, delay, 0);
    s->co->up->health_changed(s->co);
}

/* The flags a unit file gives rank `rank` of group `group` (systemd/stepd-worker@.service),
 * plus the sizes and the operator's worker flags. */
static void rank_argv(const struct serve *s, unsigned group, unsigned rank, struct rank_argv *ra)
{
    int n = 0;

#define ARG(...) snprintf(ra->a[n], sizeof(ra->a[n]), __VA_ARGS__), n++
    ARG("%s", s->worker_bin);
    ARG("--coordinator"); ARG("%s", s->ctl_addr);
    ARG("--group"); ARG("g%u", group);
    ARG("--rank"); ARG("%u", rank);
    ARG("--world-size"); ARG("%u", s->world);
    ARG("--device");
    if (strcmp(s->o.device, "cuda") == 0)
        ARG("cuda:%u", group * s->world + rank);
    else
        ARG("cpu");
    ARG("--model"); ARG("%s", s->model_dir);
    ARG("--control-key-file"); ARG("%s", s->key_file);
    ARG("--engine-listen"); ARG("unix:%s/engine-g%u.sock", s->rundir, group);
    if (s->threads) {
        ARG("--threads"); ARG("%u", s->threads);
    }
    if (s->o.speculative_config) {
        ARG("--speculative-config"); ARG("%s", s->o.speculative_config);
    }
    if (s->o.max_model_len) {
        ARG("--max-model-len"); ARG("%u", s->o.max_model_len);
    }
    if (s->o.max_num_batched_tokens) {
        ARG("--max-batched-tokens"); ARG("%u", s->o.max_num_batched_tokens);
    }
    if (s->o.max_num_seqs) {
        ARG("--max-seqs"); ARG("%u", s->o.max_num_seqs);
    }
    if (s->pass_gpu_mem) {
        ARG("--gpu-memory-utilization"); ARG("%g", s->o.gpu_memory_utilization);
    }
    if (s->o.kv_cache_dtype) {
        ARG("--kv-cache-dtype"); ARG("%s", s->o.kv_cache_dtype);
    }
    if (s->o.kv_cache_memory > 0) {
        ARG("--kv-cache-memory"); ARG("%" PRId64, s->o.kv_cache_memory);
    }
    if (s->o.block_size) {
        ARG("--block-size"); ARG("%u", s->o.block_size);
    }
    if (s->o.prefix_caching == 0)
        ARG("--no-enable-prefix-caching");
    if (s->o.allow_long_max_model_len)
        ARG("--allow-long-max-model-len");
#undef ARG
    for (int i = 0; i < n; i++)
        ra->argv[i] = ra->a[i];
    const char *wa = s->worker_args;
    for (size_t i = 0; wa && i < s->n_wargs && n < SERVE_MAX_ARGS; i++) {
        ra->argv[n++] = (char *)wa;
        wa += strlen(wa) + 1;
    }
    ra->argv[n] = NULL;
    ra->n = n;
}

static void rank_start(struct srank *rk)
{
    struct serve *s = rk->s;
    struct rank_argv *ra = malloc(sizeof(*ra));
    char **argv;

    if (!ra) {
        log_error("group %s rank %u: out of memory", rk->g->name, rk->rank);
        return;
    }
    rank_argv(s, (unsigned)(rk->g - s->groups), rk->rank, ra);
    argv = ra->argv;

    /* the environment, less what belongs to this process only (its service manager's
     * notification socket and watchdog), plus the supervisor's pid (the rank ends with us) */
    size_t ne = 0;
    for (char **e = environ; *e; e++)
        ne++;
    char **env = calloc(ne + 2, sizeof(*env));
    char pidvar[48];
    size_t k = 0;
    if (!env) {
        log_error("group %s rank %u: out of memory", rk->g->name, rk->rank);
        free(ra);
        return;
    }
    for (char **e = environ; *e; e++)
        if (strncmp(*e, "NOTIFY_SOCKET=", 14) && strncmp(*e, "WATCHDOG_USEC=", 14) &&
            strncmp(*e, "WATCHDOG_PID=", 13) && strncmp(*e, "STEPD_CONTROL_KEY=", 18) &&
            strncmp(*e, "STEPD_API_KEY=", 14) && strncmp(*e, "STEPD_SUPERVISOR_PID=", 21))
            env[k++] = *e;
    snprintf(pidvar, sizeof(pidvar), "STEPD_SUPERVISOR_PID=%d", (int)getpid());
    env[k++] = pidvar;
    env[k] = NULL;

    uv_stdio_container_t stdio[3] = {
        { .flags = UV_IGNORE },
        { .flags = UV_INHERIT_FD, .data.fd = 1 },
        { .flags = UV_INHERIT_FD, .data.fd = 2 },
    };
    uv_process_options_t po = {
        .exit_cb = on_exit_cb, .file = argv[0], .args = argv, .env = env,
        /* its own session: a terminal's Ctrl-C reaches stepd alone, which drains and then
         * stops the ranks in order */
        .flags = UV_PROCESS_DETACHED, .stdio_count = 3, .stdio = stdio,
    };
    uv_process_t *p = calloc(1, sizeof(*p));
    int r = p ? uv_spawn(&s->co->loop, p, &po) : UV_ENOMEM;
    free(env);
    free(ra);
    if (r < 0) {
        char why[256];
        snprintf(why, sizeof(why), "cannot start %.160s: %s", s->worker_bin, uv_strerror(r));
        if (p && uv_is_active((uv_handle_t *)p))
            uv_close((uv_handle_t *)p, NULL);
        else
            free(p);
        group_give_up(rk->g, why);
        return;
    }
    p->data = rk;
    rk->proc = p;
    rk->pid = p->pid;
    rk->running = true;
    rk->term_sent = false;
    rk->started_ms = rpc_now_ms();
    if (rk->restarts++)
        log_notice("group %s rank %u restarted: pid %d (restart %" PRIu64 ")", rk->g->name, rk->rank, rk->pid,
                   rk->restarts - 1);
    else
        log_info("group %s rank %u started: pid %d", rk->g->name, rk->rank, rk->pid);
    snprintf(rk->message, sizeof(rk->message), "started (pid %d)", rk->pid);
}

/* ------------------------------------------------------------------ periodic */

static void log_spec_metrics(struct serve *s)
{
    const struct metrics *m = &s->co->m;
    uint64_t drafts = m->spec_drafts - s->spec_drafts, tokens = m->spec_draft_tokens - s->spec_tokens;
    uint64_t acc = m->spec_accepted - s->spec_accepted;
    char pos[160] = "";
    size_t off = 0;

    if (drafts && s->spec_k > 0) {
        for (int i = 0; i < s->spec_k && i < METRICS_MAX_POS && off < sizeof(pos) - 16; i++)
            off += (size_t)snprintf(pos + off, sizeof(pos) - off, "%s%.3f", i ? ", " : "",
                                    (double)(m->spec_accepted_pos[i] - s->spec_pos[i]) / (double)drafts);
        log_info("spec decode metrics: mean acceptance length %.2f, accepted %" PRIu64 " of %" PRIu64
                 " draft tokens (%.1f%%) in %" PRIu64 " drafts over %.0f s; per-position acceptance rate: %s",
                 1.0 + (double)acc / (double)drafts, acc, tokens, tokens ? 100.0 * (double)acc / (double)tokens : 0.0,
                 drafts, (double)s->o.spec_log_interval_ms / 1000.0, pos);
    }
    s->spec_drafts = m->spec_drafts;
    s->spec_tokens = m->spec_draft_tokens;
    s->spec_accepted = m->spec_accepted;
    memcpy(s->spec_pos, m->spec_accepted_pos, sizeof(s->spec_pos));
}

/* True once every group is ready or given up (the READY=1 point in serve mode). */
static bool serve_settled(const struct serve *s)
{
    for (unsigned d = 0; d < s->n_groups; d++) {
        const struct sgroup *g = &s->groups[d];
        if (!g->given_up && !(g->wg && g->wg->state == GROUP_READY))
            return false;
    }
    return true;
}

void serve_check(struct serve *s)
{
    struct coord *co;
    int64_t now = rpc_now_ms();
    unsigned ready = 0;

    if (!s || !s->co || s->stopping || s->in_check)
        return;
    co = s->co;
    s->in_check = true;
    for (unsigned d = 0; d < s->n_groups; d++) {
        struct sgroup *g = &s->groups[d];
        if (g->wg && g->wg->state == GROUP_READY) {
            ready++;
            g->ever_ready = true;
            for (unsigned i = 0; i < s->world; i++)
                if (g->ranks[i].failures) {
                    g->ranks[i].failures = 0;  /* it worked: count from scratch next time */
                    snprintf(g->ranks[i].message, sizeof(g->ranks[i].message), "running (pid %d)",
                             g->ranks[i].pid);
                }
        }
        group_update_coord(g);
    }
    if (!s->startup_logged && ready == s->n_groups) {
        s->startup_logged = true;
        log_notice("startup complete in %.1f s: serving '%s' (%u group%s of %u rank%s, %s) on public %s "
                   "(port %d), admin %s (port %d), control %s (port %d), metrics %s (port %d), OpenAI HTTP %s "
                   "(port %d)",
                   (double)(now - s->start_ms) / 1000.0, co->o.model_name ? co->o.model_name : s->model_dir,
                   s->n_groups, s->n_groups == 1 ? "" : "s", s->world, s->world == 1 ? "" : "s", s->o.device,
                   co->o.listen, co->pub_port, co->o.admin_listen, co->admin_port, co->o.control_listen,
                   co->ctl_port, co->o.metrics_listen && co->o.metrics_listen[0] ? co->o.metrics_listen : "off",
                   co->metrics_port, co->o.http_port >= 0 ? co->o.http_host : "off", co->http_port);
    }
    if (!s->ready_sent && serve_settled(s)) {
        s->ready_sent = true;
        notify_ready();
        co->up->status_line(co);
    }
    s->in_check = false;
}

static void tick_cb(uv_timer_t *t)
{
    struct serve *s = t->data;
    int64_t now = rpc_now_ms();

    if (s->stopping)
        return;
    serve_check(s);
    if (!s->ready_sent) {
        /* ranks are still loading: stretch the service manager's start timeout, past the
         * longest backoff; failures are bounded by the restart limit */
        uint64_t ext = (uint64_t)s->o.backoff_max_ms * 1000 + 60000000ull;
        notify_extend_timeout(ext);
    }
    if (s->o.spec_log_interval_ms && now - s->spec_last_ms >= (int64_t)s->o.spec_log_interval_ms) {
        s->spec_last_ms = now;
        log_spec_metrics(s);
    }
}

/* ------------------------------------------------------------------ start and stop */

static void worker_ctl_addr(struct serve *s, const struct coord *co)
{
    const char *l = co->o.control_listen;

    if (strncmp(l, "unix", 4) == 0) {
        snprintf(s->ctl_addr, sizeof(s->ctl_addr), "%s", l);
    } else if (l[0] == '[') {
        const char *end = strchr(l, ']');
        size_t hl = end ? (size_t)(end - l - 1) : 0;
        if (hl == 2 && strncmp(l + 1, "::", 2) == 0)
            snprintf(s->ctl_addr, sizeof(s->ctl_addr), "[::1]:%d", co->ctl_port);
        else
            snprintf(s->ctl_addr, sizeof(s->ctl_addr), "[%.*s]:%d", (int)hl, l + 1, co->ctl_port);
    } else {
        const char *colon = strrchr(l, ':');
        size_t hl = colon ? (size_t)(colon - l) : strlen(l);
        if (hl == 0 || (hl == 7 && strncmp(l, "0.0.0.0", 7) == 0))
            snprintf(s->ctl_addr, sizeof(s->ctl_addr), "127.0.0.1:%d", co->ctl_port);
        else
            snprintf(s->ctl_addr, sizeof(s->ctl_addr), "%.*s:%d", (int)hl, l, co->ctl_port);
    }
}

int serve_start(struct serve *s, struct coord *co)
{
    s->co = co;
    co->serve = s;
    s->start_ms = s->spec_last_ms = rpc_now_ms();
    worker_ctl_addr(s, co);
    uv_timer_init(&co->loop, &s->t_tick);
    uv_timer_init(&co->loop, &s->t_stop);
    s->t_tick.data = s->t_stop.data = s;
    s->timers_on = true;
    log_info("starting %u group%s of %u rank%s on %s (%s), control key in %s", s->n_groups,
             s->n_groups == 1 ? "" : "s", s->world, s->world == 1 ? "" : "s", s->o.device, s->worker_bin,
             s->key_file);
    for (unsigned d = 0; d < s->n_groups; d++) {
        struct sgroup *g = &s->groups[d];
        snprintf(g->name, sizeof(g->name), "g%u", d);
        g->wg = wpool_group_get(co, g->name, s->world, true);
        if (!g->wg)
            return -ENOMEM;
        for (unsigned i = 0; i < s->world; i++) {
            struct srank *rk = &g->ranks[i];
            rk->s = s;
            rk->g = g;
            rk->rank = i;
            uv_timer_init(&co->loop, &rk->t_restart);
            rk->t_restart.data = rk;
        }
    }
    for (unsigned d = 0; d < s->n_groups; d++)
        for (unsigned i = 0; i < s->world; i++)
            rank_start(&s->groups[d].ranks[i]);
    uv_timer_start(&s->t_tick, tick_cb, SERVE_TICK_MS, SERVE_TICK_MS);
    return 0;
}

static unsigned running_count(const struct serve *s)
{
    unsigned n = 0;
    for (unsigned d = 0; d < s->n_groups; d++)
        for (unsigned i = 0; i < s->world; i++)
            n += s->groups[d].ranks[i].running;
    return n;
}

static void maybe_closed(struct serve *s)
{
    if (s->closed || running_count(s) > 0)
        return;
    /* every rank has exited (their process handles close on their own) */
    s->closed = true;
    log_info("every worker rank has exited");
    uv_close((uv_handle_t *)&s->t_tick, NULL);
    uv_close((uv_handle_t *)&s->t_stop, NULL);
    for (unsigned d = 0; d < s->n_groups; d++)
        for (unsigned i = 0; i < s->world; i++)
            uv_close((uv_handle_t *)&s->groups[d].ranks[i].t_restart, NULL);
}

/* Stage 0: ranks got Shutdown on their sessions (the coordinator does that right after);
 * stage 1 (worker_stop_timeout): SIGTERM rank 0 of each group, which stops its followers;
 * stage 2 (+1 s): SIGTERM the rest; stage 3 (2 x timeout): SIGKILL. */
static void stop_cb(uv_timer_t *t)
{
    struct serve *s = t->data;
    unsigned left = running_count(s);

    if (!left)
        return;
    s->stop_stage++;
    for (unsigned d = 0; d < s->n_groups; d++)
        for (unsigned i = 0; i < s->world; i++) {
            struct srank *rk = &s->groups[d].ranks[i];
            if (!rk->running)
                continue;
            if (s->stop_stage == 1 && i == 0)
                rank_signal(rk, SIGTERM);
            else if (s->stop_stage == 2)
                rank_signal(rk, SIGTERM);
            else if (s->stop_stage >= 3)
                rank_signal(rk, SIGKILL);
        }
    log_warn("stopping workers: %u still running after the %s; sent %s", left,
             s->stop_stage == 1 ? "stop timeout" : "grace period", s->stop_stage == 1 ? "SIGTERM to rank 0 of "
             "each group" : s->stop_stage == 2 ? "SIGTERM to every rank" : "SIGKILL");
    if (s->stop_stage == 1)
        uv_timer_start(t, stop_cb, 1000, 0);
    else if (s->stop_stage == 2)
        uv_timer_start(t, stop_cb, s->o.worker_stop_timeout_ms, 0);
}

void serve_shutdown(struct serve *s)
{
    if (!s || s->stopping)
        return;
    s->stopping = true;
    uv_timer_stop(&s->t_tick);
    for (unsigned d = 0; d < s->n_groups; d++)
        for (unsigned i = 0; i < s->world; i++) {
            struct srank *rk = &s->groups[d].ranks[i];
            uv_timer_stop(&rk->t_restart);
            rk->restart_at_ms = 0;
            /* a rank without a session gets no Shutdown: it is told by a signal */
            struct group *wg = s->groups[d].wg;
            if (rk->running && !(wg && wg->ranks[i].present))
                rank_signal(rk, SIGTERM);
        }
    unsigned left = running_count(s);
    log_info("stopping %u worker rank%s (Shutdown on their sessions; SIGTERM after %.0f s)", left,
             left == 1 ? "" : "s", (double)s->o.worker_stop_timeout_ms / 1000.0);
    uv_timer_start(&s->t_stop, stop_cb, s->o.worker_stop_timeout_ms, 0);
    maybe_closed(s);
}

void serve_free(struct serve *s)
{
    if (!s)
        return;
    if (s->rundir[0]) {
        DIR *d = opendir(s->rundir);
        if (d) {
            struct dirent *de;
            while ((de = readdir(d)))
                if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
                    unlinkat(dirfd(d), de->d_name, 0);
            closedir(d);
        }
        if (rmdir(s->rundir) < 0)
            log_warn("%s: %s", s->rundir, strerror(errno));
    }
    free(s->worker_args);
    free(s);
}

/* ------------------------------------------------------------------ what others ask */

const char *serve_rank_message(const struct serve *s, const char *group, unsigned rank)
{
    if (!s || rank >= s->world)
        return NULL;
    for (unsigned d = 0; d < s->n_groups; d++)
        if (strcmp(s->groups[d].name, group) == 0)
            return s->groups[d].ranks[rank].message[0] ? s->groups[d].ranks[rank].message : NULL;
    return NULL;
}

void serve_unready_reason(const struct serve *s, char *buf, size_t n)
{
    size_t off = 0;

    buf[0] = '\0';
    if (!s)
        return;
    for (unsigned d = 0; d < s->n_groups && off + 1 < n; d++) {
        const struct sgroup *g = &s->groups[d];
        const char *st = g->given_up ? g->reason :
                         g->wg && g->wg->state == GROUP_READY ? NULL :
                         g->wg && g->wg->state == GROUP_LOADING ? "loading" : "starting";
        if (st)
            off += (size_t)snprintf(buf + off, n - off, "%sgroup %s: %s", off ? "; " : "", g->name, st);
    }
}

void serve_status(const struct serve *s, char *buf, size_t n)
{
    unsigned up = 0, given = 0, restarting = 0;

    for (unsigned d = 0; d < s->n_groups; d++) {
        given += s->groups[d].given_up;
        for (unsigned i = 0; i < s->world; i++) {
            up += s->groups[d].ranks[i].running;
            restarting += s->groups[d].ranks[i].restart_at_ms != 0;
        }
    }
    int off = snprintf(buf, n, "workers %u/%u running", up, s->n_groups * s->world);
    if (restarting && off >= 0 && (size_t)off < n)
        off += snprintf(buf + off, n - (size_t)off, ", %u restarting", restarting);
    if (given && off >= 0 && (size_t)off < n)
        snprintf(buf + off, n - (size_t)off, ", %u group%s given up", given, given == 1 ? "" : "s");
}
