/* unit.h - shared by the cmocka unit tests: a main that runs one case when
 * ctest names it (argv[1]; a name that matches no case fails), and scratch
 * directories. */
#ifndef STK_UNIT_H
#define STK_UNIT_H

#include <fnmatch.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

/* A fresh empty directory under the test's scratch area ($STK_TMP). */
static inline const char *scratch(const char *name)
{
    static char path[1024];
    const char *base = getenv("STK_TMP");
    base = base ? base : "/tmp/stk-unit";
    snprintf(path, sizeof path, "%s/%s", base, name);
    char cmd[4 * 1024 + 64];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s/.%s.partial' && mkdir -p '%s'",
             path, base, name, path);
    if (system(cmd) != 0)
        fail_msg("cannot make %s", path);
    return path;
}

/* Whether filter (cmocka's pattern: * and ? wildcards) names one of the n
 * cases: a filter that matches nothing would run nothing and pass. */
static inline int unit_filter_matches(const struct CMUnitTest *t, size_t n,
                                      const char *filter)
{
    for (size_t i = 0; i < n; i++)
        if (fnmatch(filter, t[i].name, 0) == 0)
            return 1;
    fprintf(stderr, "unit: no case matches '%s'\n", filter);
    return 0;
}

#define UNIT_MAIN_WITH(tests, setup, teardown)                                 \
    int main(int argc, char **argv)                                            \
    {                                                                          \
        if (argc > 1) {                                                        \
            if (!unit_filter_matches(tests, sizeof tests / sizeof *tests,      \
                                     argv[1]))                                 \
                return 1;                                                      \
            cmocka_set_test_filter(argv[1]);                                   \
        }                                                                      \
        return cmocka_run_group_tests(tests, setup, teardown);                 \
    }

#define UNIT_MAIN(tests) UNIT_MAIN_WITH(tests, NULL, NULL)

#endif
