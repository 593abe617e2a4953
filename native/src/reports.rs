//! What the native plane tells Python, in batches Python drains off the
//! hot path: the reads it served and the files it opened in passthrough
//! (for the workload model, the cache's policy and the metrics), the inodes that are gone (for `fs.py`'s
//! table), and how many requests of each kind it answered.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// The operations answered natively, by the names Python's metrics use.
pub const ANSWERED: [&str; 10] = [
    "lookup",
    "getattr",
    "read",
    "forget",
    "batch_forget",
    "open",
    "release",
    "flush",
    "readdirplus",
    "releasedir",
];
pub const LOOKUP: usize = 0;
pub const GETATTR: usize = 1;
pub const READ: usize = 2;
pub const FORGET: usize = 3;
pub const BATCH_FORGET: usize = 4;
pub const OPEN: usize = 5;
pub const RELEASE: usize = 6;
pub const FLUSH: usize = 7;
pub const READDIRPLUS: usize = 8;
pub const RELEASEDIR: usize = 9;

/// One READ answered from cache files.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadReport {
    pub inode: u64,
    pub offset: u64,
    pub size: u64,
    pub pid: u32,
    /// Bytes served by tier name.
    pub served: Vec<(Arc<str>, u64)>,
    pub seconds: f64,
}

/// One open answered in passthrough: the kernel reads the whole file of
/// the tier named, unseen.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenReport {
    pub inode: u64,
    pub pid: u32,
    pub tier: Arc<str>,
}

#[derive(Debug, Default)]
pub struct Pending {
    pub reads: Vec<ReadReport>,
    pub opens: Vec<OpenReport>,
    pub forgotten: Vec<u64>,
    pub answered: [u64; ANSWERED.len()],
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.reads.is_empty()
            && self.opens.is_empty()
            && self.forgotten.is_empty()
            && self.answered.iter().all(|&count| count == 0)
    }
}

#[derive(Default)]
pub struct Reports {
    pending: Mutex<Pending>,
    ready: Condvar,
}

impl Reports {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // Each update is one push or one addition: a panic leaves none half done.
        self.pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn add(&self, update: impl FnOnce(&mut Pending)) {
        let mut pending = self.pending();
        let was_empty = pending.is_empty();
        update(&mut pending);
        if was_empty {
            self.ready.notify_all();
        }
    }

    pub fn read(&self, report: ReadReport) {
        self.add(|pending| {
            pending.reads.push(report);
            pending.answered[READ] += 1;
        });
    }

    pub fn opened(&self, report: OpenReport) {
        self.add(|pending| {
            pending.opens.push(report);
            pending.answered[OPEN] += 1;
        });
    }

    pub fn answered(&self, operation: usize) {
        self.add(|pending| pending.answered[operation] += 1);
    }

    pub fn forgotten(&self, inodes: Vec<u64>) {
        if !inodes.is_empty() {
            self.add(|pending| pending.forgotten.extend(inodes));
        }
    }

    /// Everything reported so far, once there is something or `timeout` passed.
    pub fn wait(&self, timeout: Duration) -> Pending {
        let pending = self.pending();
        let (mut pending, _) = self
            .ready
            .wait_timeout_while(pending, timeout, |pending| pending.is_empty())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        std::mem::take(&mut *pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_taken_once_in_the_order_made() {
        let reports = Reports::default();
        reports.forgotten(vec![3]);
        reports.answered(LOOKUP);
        reports.read(ReadReport {
            inode: 3,
            offset: 0,
            size: 5,
            pid: 1,
            served: vec![(Arc::from("hot"), 5)],
            seconds: 0.0,
        });
        reports.forgotten(vec![4, 5]);
        let pending = reports.wait(Duration::ZERO);
        assert_eq!(pending.forgotten, vec![3, 4, 5]);
        assert_eq!(pending.answered[LOOKUP], 1);
        assert_eq!(pending.answered[READ], 1);
        assert_eq!(pending.reads[0].inode, 3);
        assert!(reports.wait(Duration::ZERO).is_empty());
    }
}
