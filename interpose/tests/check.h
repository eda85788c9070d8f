/* A minimal test harness: CHECK records a failure with its location and goes
 * on; RUN counts a test case as passed when none of its checks failed;
 * check_report prints the closing "N passed, M failed" line and gives the
 * exit status. */
#ifndef NPUALLOC_TESTS_CHECK_H
#define NPUALLOC_TESTS_CHECK_H

#include <stdio.h>

static int check_failures, check_cases_passed, check_cases_failed;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            check_failures++;                                                        \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                            \
    } while (0)

/* Integer comparison that shows both values when it fails. */
#define CHECK_EQ(actual, expected)                                                                          \
    do {                                                                                                    \
        long long check_a_ = (long long)(actual), check_e_ = (long long)(expected);                        \
        if (check_a_ != check_e_) {                                                                         \
            check_failures++;                                                                               \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %lld, expected %s == %lld\n", __FILE__, __LINE__, \
                    #actual, check_a_, #expected, check_e_);                                                \
        }                                                                                                   \
    } while (0)

#define RUN(test)                                                 \
    do {                                                          \
        int check_before_ = check_failures;                       \
        test();                                                   \
        if (check_failures == check_before_) check_cases_passed++; \
        else {                                                    \
            check_cases_failed++;                                 \
            fprintf(stderr, "FAILED: %s\n", #test);               \
        }                                                         \
    } while (0)

static inline int check_report(void) {
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}

#endif
