//! The worker pools `with_threads` caches are bounded: calls with many distinct thread counts do
//! not leave a pool of idle threads behind for each (alone in this test binary, so that the
//! process's thread count is this test's).

use weightszip_core::codec::with_threads;

/// The process's threads, from /proc (Linux).
fn threads_now() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

#[test]
#[cfg(target_os = "linux")]
fn many_distinct_counts_leave_a_bounded_number_of_threads() {
    for t in 1..=40 {
        assert_eq!(with_threads(t, rayon::current_num_threads), t);
    }
    // Unbounded, 1 + 2 + ... + 40 = 820 idle threads would stay; the cache keeps at most 8 pools
    // (here at most 33 + ... + 40 = 292 threads). Dropped pools' threads exit asynchronously.
    let mut n = threads_now();
    for _ in 0..100 {
        if n < 400 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        n = threads_now();
    }
    assert!(n < 400, "{n} threads left after 40 distinct pool sizes");
}
