/* replay.c - run a libFuzzer target over files without libFuzzer (CI, gcc):
 *   fuzz-replay-X FILE_OR_DIR...
 * Every input of the committed corpus must go through without a crash or a
 * sanitizer report.  Built with the normal toolchain; links one target. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;

    if (!f) {
        fprintf(stderr, "%s: cannot open\n", path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t) n + 1);
    if (!buf || fread(buf, 1, (size_t) n, f) != (size_t) n) {
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t) n);
    free(buf);
    return 1;
}

static int run(const char *path)
{
    struct stat st;
    int count = 0;

    if (stat(path, &st) < 0) {
        fprintf(stderr, "%s: not found\n", path);
        return -1;
    }
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            char sub[4096];
            int r;
            if (de->d_name[0] == '.')
                continue;
            snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name);
            r = run(sub);
            if (r < 0) {
                closedir(d);
                return r;
            }
            count += r;
        }
        if (d)
            closedir(d);
        return count;
    }
    return run_file(path);
}

int main(int argc, char **argv)
{
    int total = 0;
    for (int i = 1; i < argc; i++) {
        int r = run(argv[i]);
        if (r < 0)
            return 1;
        total += r;
    }
    printf("replayed %d inputs\n", total);
    return total > 0 ? 0 : 1;
}
