/* test-backend.c - registry and wrappers: "cpu" is built in, unknown names are -EINVAL,
 * "cuda" without its plugin/GPU is -ENODEV, NULL slots take their documented fallbacks,
 * the capability query answers per op and format. */
#include <stdatomic.h>
#include <time.h>

#include "kref.h"

static int fake_init(struct backend *be, const struct backend_cfg *cfg)
{
    return 0;
}

static void fake_free(struct backend *be)
{
}

static const struct backend_ops fake_ops = { .name = "fake", .init = fake_init, .free = fake_free };

/* split_run: each part's own single-threaded backend; `together`: both parts at once (each
 * waits for the other to start: a serial run would never finish, so each side gives up
 * after a second and the test reports it) */
struct split_t {
    struct backend *sub[2];
    _Atomic int started[2];
    bool met[2];
    bool wait;              /* each part waits for the other to start (30 s: a hang guard) */
};

static double mono_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void split_part(void *arg, int part, struct backend *sub)
{
    struct split_t *st = arg;
    double t0 = mono_s();

    st->sub[part] = sub;
    atomic_store(&st->started[part], 1);
    /* an event, not a time: parts run one after the other never see it, parts run
     * together always do, however late the other's thread is scheduled */
    while (st->wait && !atomic_load(&st->started[1 - part]) && mono_s() - t0 < 30.0)
        ;
    st->met[part] = atomic_load(&st->started[1 - part]);
}

static void test_split_run(void)
{
    struct backend *be;
    struct backend_cfg cfg = { .n_threads = 2 };
    struct split_t st = { 0 };
    float x[64], y[64];

    ASSERT_OK(backend_new("cpu", &cfg, &be));
    ASSERT_EQ(backend_split_width(be), 2);
    ASSERT_ERR(backend_split_run(be, 3, false, split_part, &st), -EINVAL);
    /* together: the parts run at the same time (each waits for the other) */
    st.wait = true;
    ASSERT_OK(backend_split_run(be, 2, true, split_part, &st));
    ASSERT_TRUE(st.met[0] && st.met[1]);
    /* not together: both parts run, on their own backends (maybe one after the other) */
    {
        struct split_t s2 = { 0 };

        ASSERT_OK(backend_split_run(be, 2, false, split_part, &s2));
        ASSERT_TRUE(atomic_load(&s2.started[0]) && atomic_load(&s2.started[1]));
        ASSERT_TRUE(s2.sub[0] && s2.sub[1] && s2.sub[0] != be && s2.sub[1] != be);
    }
    ASSERT_TRUE(st.sub[0] && st.sub[1] && st.sub[0] != st.sub[1] && st.sub[0] != be);
    /* a sub-backend is a working backend of its own */
    for (int i = 0; i < 64; i++)
        x[i] = (float)i;
    memcpy(y, x, sizeof(y));
    ASSERT_OK(backend_add(st.sub[1], y, x, 64));
    ASSERT_TRUE(y[10] == 20.0f && y[63] == 126.0f);
    backend_free(be);
    cfg.n_threads = 1;
    ASSERT_OK(backend_new("cpu", &cfg, &be));
    ASSERT_EQ(backend_split_width(be), 1);
    backend_free(be);
    printf("split_run: 2 parts at once on their own backends\n");
}

int main(void)
{
    struct backend *be = NULL;
    struct backend_cfg cfg = { .n_threads = 0 };
    int r;

    ASSERT_OK(backend_new("cpu", &cfg, &be));
    ASSERT_STREQ(be->ops->name, "cpu");
    ASSERT_TRUE(backend_supports(be, "matmul", WFMT_MXFP4));
    ASSERT_TRUE(backend_supports(be, "moe", WFMT_BF16));
    ASSERT_TRUE(!backend_supports(be, "rmsnorm", WFMT_MXFP4));
    ASSERT_TRUE(!backend_supports(be, "no_such_op", WFMT_F32));
    {
        void *p = NULL;
        char src[100], dst[100];

        ASSERT_OK(backend_buf_alloc(be, 1000, 256, &p));
        ASSERT_EQ((uintptr_t)p % 256, 0);
        memset(src, 7, sizeof(src));
        ASSERT_OK(backend_upload(be, p, src, sizeof(src)));
        ASSERT_OK(backend_download(be, dst, p, sizeof(dst)));
        ASSERT_TRUE(memcmp(src, dst, sizeof(src)) == 0);
        ASSERT_OK(backend_sync(be));
        backend_buf_free(be, p);
    }
    test_split_run();
    ASSERT_OK(backend_graph_begin(be));     /* CPU: the pool's busy mode for one step */
    ASSERT_OK(backend_graph_end(be));
    backend_free(be);
    backend_free(NULL);

    ASSERT_ERR(backend_new("tpu", NULL, &be), -EINVAL);
    ASSERT_TRUE(be == NULL);
    cfg.n_threads = -1;
    ASSERT_ERR(backend_new("cpu", &cfg, &be), -EINVAL);

    /* cuda: plugin absent or no device here -> -ENODEV; on a GPU machine it may work */
    r = backend_new("cuda", NULL, &be);
    ASSERT_TRUE(r == -ENODEV || r == 0);
    if (r == 0)
        backend_free(be);

    /* NULL-slot fallbacks of the wrappers */
    {
        struct backend fake = { .ops = &fake_ops };
        struct bweight w = kref_f32_new(2, 2, 1.0f);
        float x[2] = { 1, 2 }, y[2];
        void *p = NULL;

        ASSERT_OK(backend_buf_alloc(&fake, 64, 64, &p));
        ASSERT_OK(backend_upload(&fake, p, x, sizeof(x)));
        ASSERT_OK(backend_download(&fake, y, p, sizeof(y)));
        ASSERT_EQ(y[1] == 2.0f, 1);
        backend_buf_free(&fake, p);
        ASSERT_OK(backend_sync(&fake));
        ASSERT_TRUE(backend_supports(&fake, "matmul", WFMT_BF16));
        ASSERT_OK(backend_weight_prepare(&fake, &w));
        ASSERT_ERR(backend_matmul(&fake, &w, x, 1, y), -ENOSYS);
        ASSERT_ERR(backend_add(&fake, y, x, 2), -ENOSYS);
        ASSERT_EQ(backend_split_width(&fake), 1);
        ASSERT_ERR(backend_split_run(&fake, 1, false, split_part, NULL), -ENOSYS);
        backend_weight_release(&fake, &w);
        kref_weight_free(&w);
    }
    printf("backend: all checks passed (%s)\n", backend_names());
    return 0;
}
