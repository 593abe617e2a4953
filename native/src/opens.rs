//! Which opens the kernel serves itself from a cache file (FUSE
//! passthrough), by the kernel's rules for an inode:
//!
//! - all its open files are passthrough ones, on one backing file, or none
//!   is: an open in cached mode while it has a passthrough one, or a
//!   passthrough open while it has a cached one, fails (EIO in the opener),
//!   as does a second backing file;
//! - a backing id, once registered, stays valid until it is closed,
//!   whatever happens to the cache file (the kernel holds the file open),
//!   so the inode's last release closes it.
//!
//! An inode whose opens are all cached (a cold read in progress) stays
//! cached until they are all released; an inode with a passthrough open
//! gets passthrough for every further open, on the same backing id. What
//! counts as released is our RELEASE answer, which comes after the kernel
//! dropped its own count: ours are never below the kernel's, so a choice
//! made from ours never breaks its rules.
//!
//! The first open of an inode with neither kind looks for its file
//! (`begin` says `Find`, `finish` takes what was found): a native worker
//! looks in `Tables`, Python in the cache. Meanwhile the inode is being
//! found: another native open of it goes to Python, which waits.
//!
//! A backing file is a version's (its cache file) or a staged file's. An
//! open that stages a version to write it (`begin_writer`) is refused while
//! the version is open on its cache file, and until it is staged
//! (`end_writer`) new opens of the version are cached ones: a writer must
//! never be handed the cache file, nor a reader the staged one.
//!
//! Concurrency: one mutex guards every inode's counts, and a condvar wakes
//! Python's opens that wait for a find.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Registering backing files with the connection (`device::Backing`).
pub trait BackingFiles {
    fn register(&self, fd: RawFd) -> io::Result<u32>;
    fn unregister(&self, backing_id: u32) -> io::Result<()>;
}

/// A passthrough open's backing file: its id, the tier its file lies in,
/// and whether it is a staged file (else a version's cache file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backing {
    pub id: u32,
    pub tier: Arc<str>,
    pub staged: bool,
}

/// How an open is answered: cached (the daemon serves its reads), or
/// through the kernel on a backing file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    Cached,
    Through(Backing),
}

/// What `begin` decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Begin {
    Decided(Opened),
    /// The inode's file is to be found, then `finish`ed (or `abandon`ed).
    Find,
    /// Another open is finding the inode's file (only when not waiting).
    BeingFound,
    /// The inode is open on the other kind of file (a version's cache
    /// file, or a staged file).
    Busy,
}

#[derive(Debug, Default)]
struct InodeOpens {
    cached: u64,
    through: u64,
    backing: Option<Backing>,
    finding: bool,
    /// An open is staging the version to write it.
    writer: bool,
}

impl InodeOpens {
    fn idle(&self) -> bool {
        self.cached == 0 && self.through == 0 && !self.finding && !self.writer
    }
}

pub struct Opens<B> {
    backing: B,
    inodes: Mutex<HashMap<u64, InodeOpens>>,
    found: Condvar,
}

impl<B: BackingFiles> Opens<B> {
    pub fn new(backing: B) -> Self {
        Opens {
            backing,
            inodes: Mutex::new(HashMap::new()),
            found: Condvar::new(),
        }
    }

    fn inodes(&self) -> MutexGuard<'_, HashMap<u64, InodeOpens>> {
        // Each change is a count or a flag set at once: a panic leaves them whole.
        self.inodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wait while another open of `inode` finds its file; the lock again.
    fn settled<'a>(
        &'a self,
        mut inodes: MutexGuard<'a, HashMap<u64, InodeOpens>>,
        inode: u64,
    ) -> MutexGuard<'a, HashMap<u64, InodeOpens>> {
        while inodes.get(&inode).is_some_and(|opens| opens.finding) {
            inodes = self
                .found
                .wait(inodes)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        inodes
    }

    /// Open `inode` (a `staged` file's, else a version's) by the rules, if
    /// they decide without its file; else it is now being found. `wait`:
    /// wait for another open's find first, rather than answer
    /// `BeingFound`. A staged file's open is `Busy` while the version is on
    /// its cache file, and the other way round.
    pub fn begin(&self, inode: u64, wait: bool, staged: bool) -> Begin {
        let inodes = self.inodes();
        if !wait && inodes.get(&inode).is_some_and(|opens| opens.finding) {
            return Begin::BeingFound;
        }
        let mut inodes = self.settled(inodes, inode);
        let opens = inodes.entry(inode).or_default();
        if opens.cached > 0 || (opens.writer && !staged) {
            opens.cached += 1;
            return Begin::Decided(Opened::Cached);
        }
        if let Some(backing) = &opens.backing {
            if backing.staged != staged {
                return Begin::Busy;
            }
            opens.through += 1;
            return Begin::Decided(Opened::Through(backing.clone()));
        }
        opens.finding = true;
        Begin::Find
    }

    /// An open of `inode` is to stage the version to write it: false if the
    /// version is open on its cache file (waiting for a find to end first);
    /// else, until `end_writer`, new opens of the version are cached ones.
    pub fn begin_writer(&self, inode: u64) -> bool {
        let mut inodes = self.settled(self.inodes(), inode);
        let opens = inodes.entry(inode).or_default();
        if opens
            .backing
            .as_ref()
            .is_some_and(|backing| !backing.staged)
        {
            if opens.idle() {
                inodes.remove(&inode);
            }
            return false;
        }
        opens.writer = true;
        true
    }

    /// The writer `begin_writer` let in has staged the version, or failed.
    pub fn end_writer(&self, inode: u64) {
        let mut inodes = self.inodes();
        if let Some(opens) = inodes.get_mut(&inode) {
            opens.writer = false;
            if opens.idle() {
                inodes.remove(&inode);
            }
        }
    }

    /// The open `begin` left to find its file ends with `found` (a
    /// descriptor of the file and its tier; the caller keeps and closes
    /// it): through it, or cached if there is none or the kernel refuses it.
    pub fn finish(&self, inode: u64, found: Option<(RawFd, Arc<str>)>, staged: bool) -> Opened {
        let mut inodes = self.inodes();
        let opens = inodes.entry(inode).or_default();
        opens.finding = false;
        self.found.notify_all();
        if let Some((fd, tier)) = found {
            match self.backing.register(fd) {
                Ok(id) => opens.backing = Some(Backing { id, tier, staged }),
                Err(error) => eprintln!(
                    "cachefsd: cannot hand a cache file to the kernel: {error}; the daemon serves it"
                ),
            }
        }
        match &opens.backing {
            Some(backing) => {
                opens.through += 1;
                Opened::Through(backing.clone())
            }
            None => {
                opens.cached += 1;
                Opened::Cached
            }
        }
    }

    /// The open `begin` left to find its file was given up: nothing opened.
    pub fn abandon(&self, inode: u64) {
        let mut inodes = self.inodes();
        if let Some(opens) = inodes.get_mut(&inode) {
            opens.finding = false;
            if opens.idle() {
                inodes.remove(&inode);
            }
        }
        self.found.notify_all();
    }

    /// An open of `inode` was released (`through`: a passthrough one); its
    /// last passthrough one closes the backing id.
    pub fn release(&self, inode: u64, through: bool) {
        let mut inodes = self.inodes();
        let Some(opens) = inodes.get_mut(&inode) else {
            return;
        };
        if through {
            opens.through = opens.through.saturating_sub(1);
            if opens.through == 0 {
                if let Some(backing) = opens.backing.take() {
                    if let Err(error) = self.backing.unregister(backing.id) {
                        eprintln!("cachefsd: cannot close backing id {}: {error}", backing.id);
                    }
                }
            }
        } else {
            opens.cached = opens.cached.saturating_sub(1);
        }
        if opens.idle() {
            inodes.remove(&inode);
        }
    }

    /// Register `fd` as a backing file and close it again: whether the
    /// kernel takes such files.
    pub fn check_backing(&self, fd: RawFd) -> io::Result<()> {
        let id = self.backing.register(fd)?;
        self.backing.unregister(id)
    }

    /// Whether any inode has a passthrough open, or may get one (its file
    /// being found): until none has, a mount that gave passthrough up still
    /// answers OPEN by these rules, as a new open of such an inode must be
    /// a passthrough one too.
    pub fn passing_through(&self) -> bool {
        self.inodes()
            .values()
            .any(|opens| opens.backing.is_some() || opens.finding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[derive(Default)]
    struct FakeBacking {
        next: AtomicU32,
        open: Mutex<Vec<u32>>,
        refuse: bool,
    }

    impl BackingFiles for &FakeBacking {
        fn register(&self, _fd: RawFd) -> io::Result<u32> {
            if self.refuse {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
            self.open.lock().unwrap().push(id);
            Ok(id)
        }

        fn unregister(&self, backing_id: u32) -> io::Result<()> {
            self.open.lock().unwrap().retain(|&id| id != backing_id);
            Ok(())
        }
    }

    fn hot() -> Option<(RawFd, Arc<str>)> {
        Some((3, Arc::from("hot")))
    }

    #[test]
    fn every_open_of_a_backed_inode_shares_its_backing_id_until_the_last_release() {
        let fake = FakeBacking::default();
        let opens = Opens::new(&fake);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        let first = opens.finish(5, hot(), false);
        let Opened::Through(backing) = first.clone() else {
            panic!("{first:?}")
        };
        assert_eq!(opens.begin(5, false, false), Begin::Decided(first));
        assert!(opens.passing_through());
        opens.release(5, true);
        assert_eq!(*fake.open.lock().unwrap(), vec![backing.id]);
        opens.release(5, true);
        assert!(fake.open.lock().unwrap().is_empty());
        assert!(!opens.passing_through());
    }

    #[test]
    fn an_inode_open_cached_stays_cached_until_all_its_opens_are_released() {
        let fake = FakeBacking::default();
        let opens = Opens::new(&fake);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        assert_eq!(opens.finish(5, None, false), Opened::Cached); // a cold read
        assert_eq!(opens.begin(5, false, false), Begin::Decided(Opened::Cached)); // its file came meanwhile
        opens.release(5, false);
        opens.release(5, false);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        assert!(matches!(opens.finish(5, hot(), false), Opened::Through(_)));
    }

    #[test]
    fn a_refused_backing_file_is_a_cached_open_and_a_find_given_up_opens_nothing() {
        let fake = FakeBacking {
            refuse: true,
            ..FakeBacking::default()
        };
        let opens = Opens::new(&fake);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        assert_eq!(opens.begin(5, false, false), Begin::BeingFound);
        assert!(opens.passing_through()); // it may be, once found
        assert_eq!(opens.finish(5, hot(), false), Opened::Cached);
        opens.release(5, false);
        assert_eq!(opens.begin(6, false, false), Begin::Find);
        opens.abandon(6);
        assert_eq!(opens.begin(6, false, false), Begin::Find); // nothing was left counted
    }

    #[test]
    fn a_waiting_open_is_decided_once_the_find_ends() {
        let fake = FakeBacking::default();
        let opens = Opens::new(&fake);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| opens.begin(5, true, false));
            opens.finish(5, None, false);
            assert_eq!(waiter.join().unwrap(), Begin::Decided(Opened::Cached));
        });
    }

    #[test]
    fn concurrent_opens_and_releases_keep_the_counts_and_close_every_id() {
        let fake = FakeBacking::default();
        let opens = Opens::new(&fake);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        let opened = match opens.begin(7, true, false) {
                            Begin::Decided(opened) => opened,
                            Begin::Find => opens.finish(7, hot(), false),
                            Begin::BeingFound | Begin::Busy => unreachable!(),
                        };
                        assert!(matches!(opened, Opened::Through(_)));
                        opens.release(7, true);
                    }
                });
            }
        });
        assert!(fake.open.lock().unwrap().is_empty());
        assert!(!opens.passing_through());
    }

    #[test]
    fn a_writer_never_gets_the_versions_cache_file_nor_a_reader_the_staged_one() {
        let fake = FakeBacking::default();
        let opens = Opens::new(&fake);
        assert_eq!(opens.begin(5, false, false), Begin::Find);
        assert!(matches!(opens.finish(5, hot(), false), Opened::Through(_)));
        assert!(!opens.begin_writer(5)); // read through the kernel now: refused
        assert_eq!(opens.begin(5, true, true), Begin::Busy);
        opens.release(5, true);
        assert!(opens.begin_writer(5));
        assert_eq!(opens.begin(5, false, false), Begin::Decided(Opened::Cached)); // staging
        opens.end_writer(5);
        opens.release(5, false);
        assert_eq!(opens.begin(5, false, true), Begin::Find); // the staged file's first open
        assert!(matches!(
            opens.finish(5, hot(), true),
            Opened::Through(Backing { staged: true, .. })
        ));
        assert_eq!(opens.begin(5, false, false), Begin::Busy);
    }
}
