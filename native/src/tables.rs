//! What the kernel knows of a mount, kept where native threads answer it:
//! its inodes (attributes, the kernel's references, the cache files that
//! hold each version's blocks) and the names that found them.
//!
//! Python's filesystem (`fs.py`) owns what an inode means (which object
//! version, which directory) and makes every inode; it `hold`s each one it
//! hands the kernel, with the name it answered. This table owns the
//! kernel's references: every FORGET is counted here, by the native
//! threads. Each change that drops inodes says which (into `gone`): a
//! Python caller applies them to its own table at once, a native thread
//! reports them, for Python to drain (`Reports`).
//!
//! An inode whose references all went (the kernel dropped it early: memory
//! pressure, `drop_caches`) stays while the name that found it is fresh
//! (for the metadata TTL Python answered it with), so a lookup of that
//! name is answered here, with the same inode, without Python. It is gone
//! once it has no references and no fresh name: its name expired, was
//! dropped (Python found it stale, renamed or removed), or now names
//! another inode.
//!
//! A READ is answered here when every block it covers lies in a raw cache
//! file Python verified and named (`set_blocks`), and that file is still
//! the one verified (device, inode and ctime unchanged: cache files are
//! named by their content's hash, written once and renamed into place, so
//! the same identity holds the same bytes). Anything else is Python's.
//!
//! Concurrency: one mutex guards the records and the names.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::abi::Attr;

/// How often expired names are swept out (and the inodes only they kept).
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// What changes when a file is written to or replaced: its device, inode
/// and ctime (Python's `tiered._file_identity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub ctime_ns: i64,
}

/// A verified raw cache file holding a block's bytes from `offset` on
/// (a block file's 0, or the block's place in a whole file).
#[derive(Debug)]
pub struct BlockFile {
    pub path: PathBuf,
    pub offset: u64,
    pub identity: FileIdentity,
    pub tier: Arc<str>,
}

/// Bytes a READ takes from one block file.
#[derive(Debug, Clone)]
pub struct Piece {
    pub file: Arc<BlockFile>,
    pub offset: u64,
    pub length: usize,
}

#[derive(Debug)]
struct Blocks {
    size: u64,
    block_size: u64,
    files: HashMap<u64, Arc<BlockFile>>,
}

type Name = (u64, Vec<u8>);

/// An entry of a listing: its name, inode and attributes, and whether they
/// are cacheable (else the kernel is told they are valid for no time).
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: Vec<u8>,
    pub inode: u64,
    pub attr: Attr,
    pub cacheable: bool,
}

impl Listed {
    /// `.` and `..`: the kernel holds no reference to either.
    pub fn is_dot(&self) -> bool {
        self.name == b"." || self.name == b".."
    }
}

/// A directory's entries as its OPENDIR found them, `.` and `..` first:
/// the kernel's READDIRPLUS offset indexes them.
#[derive(Debug)]
pub struct Listing {
    pub directory: u64,
    pub entries: Vec<Listed>,
}

#[derive(Debug)]
struct Record {
    attr: Attr,
    /// False for a file whose attributes change under the kernel (a staged
    /// one): Python answers all of it.
    cacheable: bool,
    references: u64,
    /// Open listings that hold it (`set_listing`).
    pins: u64,
    name: Option<Name>,
    blocks: Option<Blocks>,
    /// The verified file of exactly the version's bytes, from offset 0.
    whole: Option<Arc<BlockFile>>,
}

#[derive(Debug)]
struct Entry {
    inode: u64,
    fresh_until: Instant,
}

#[derive(Debug)]
struct State {
    records: HashMap<u64, Record>,
    names: HashMap<Name, Entry>,
    listings: HashMap<u64, Arc<Listing>>,
    swept: Instant,
}

/// An answer to a LOOKUP: the inode, its attributes, for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Found {
    pub inode: u64,
    pub attr: Attr,
    pub timeout: f64,
}

pub struct Tables {
    ttl: Duration,
    state: Mutex<State>,
}

impl Tables {
    pub fn new(ttl: Duration, now: Instant) -> Self {
        Tables {
            ttl,
            state: Mutex::new(State {
                records: HashMap::new(),
                names: HashMap::new(),
                listings: HashMap::new(),
                swept: now,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic under the lock leaves the tables as they were between two
        // statements of one method, each of which keeps them consistent.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Python handed the kernel `inode` as `name` in `parent`: one more
    /// reference, the name fresh for the TTL (unless not `cacheable`). An
    /// unreferenced inode the name led to before is gone.
    #[allow(clippy::too_many_arguments)] // the kernel's entry, field by field
    pub fn hold(
        &self,
        inode: u64,
        parent: u64,
        name: &[u8],
        attr: Attr,
        cacheable: bool,
        now: Instant,
        gone: &mut Vec<u64>,
    ) {
        {
            let mut guard = self.state();
            let state = &mut *guard;
            let key = (parent, name.to_vec());
            let record = state.records.entry(inode).or_insert(Record {
                attr,
                cacheable,
                references: 0,
                pins: 0,
                name: None,
                blocks: None,
                whole: None,
            });
            record.references += 1;
            record.attr = attr;
            // Once its attributes change under the kernel (staged), an
            // inode stays Python's: a hold from an older listing or lookup
            // does not make it cacheable again.
            let cacheable = record.cacheable && cacheable;
            record.cacheable = cacheable;
            if !cacheable {
                record.blocks = None;
                record.whole = None;
            }
            let before = std::mem::replace(&mut record.name, cacheable.then(|| key.clone()));
            if let Some(before) = before.filter(|before| *before != key) {
                state.names.remove(&before);
            }
            if cacheable {
                let replaced = state.names.insert(
                    key,
                    Entry {
                        inode,
                        fresh_until: now + self.ttl,
                    },
                );
                if let Some(other) = replaced.filter(|entry| entry.inode != inode) {
                    state.unname(other.inode, gone);
                }
            } else if let Some(other) = state
                .names
                .remove(&key)
                .filter(|entry| entry.inode != inode)
            {
                state.unname(other.inode, gone);
            }
        }
    }

    /// The kernel dropped `count` references to `inode`; whether the inode is gone.
    pub fn forget(&self, inode: u64, count: u64, now: Instant) -> bool {
        let mut state = self.state();
        let Some(record) = state.records.get_mut(&inode) else {
            return false;
        };
        record.references = record.references.saturating_sub(count);
        if record.references == 0 && record.pins == 0 && !state.fresh_name(inode, now) {
            let mut gone = Vec::new();
            state.remove(inode, &mut gone);
            return true;
        }
        false
    }

    /// Whether `inode` is still here (referenced, or kept by its fresh name).
    pub fn holds(&self, inode: u64) -> bool {
        self.state().records.contains_key(&inode)
    }

    /// `inode`'s attributes now change under the kernel (a staged file):
    /// counted still, answered by Python only.
    pub fn uncache(&self, inode: u64) {
        let mut state = self.state();
        let Some(record) = state.records.get_mut(&inode) else {
            return;
        };
        record.cacheable = false;
        record.blocks = None;
        record.whole = None;
        if let Some(name) = record.name.take() {
            state.names.remove(&name);
        }
    }

    /// `name` in `parent` must be asked of Python again (stale, renamed,
    /// removed); the inode it kept alone is gone.
    pub fn drop_name(&self, parent: u64, name: &[u8], gone: &mut Vec<u64>) {
        let mut state = self.state();
        if let Some(entry) = state.names.remove(&(parent, name.to_vec())) {
            state.unname(entry.inode, gone);
        }
    }

    /// The verified raw files of `inode`'s blocks `blocks` (index -> file),
    /// replacing what was known of those: a block of them not named is
    /// Python's to read. `inode` is `size` bytes cut in blocks of
    /// `block_size`; `whole` is the file of all of them, if there is one.
    pub fn set_blocks(
        &self,
        inode: u64,
        size: u64,
        block_size: u64,
        blocks: Range<u64>,
        files: Vec<(u64, BlockFile)>,
        whole: Option<BlockFile>,
    ) {
        let mut state = self.state();
        let Some(record) = state
            .records
            .get_mut(&inode)
            .filter(|record| record.cacheable)
        else {
            return;
        };
        record.whole = whole.map(Arc::new);
        let known = record.blocks.get_or_insert_with(|| Blocks {
            size,
            block_size,
            files: HashMap::new(),
        });
        known.files.retain(|index, _| !blocks.contains(index));
        known.files.extend(
            files
                .into_iter()
                .filter(|(index, _)| blocks.contains(index))
                .map(|(index, file)| (index, Arc::new(file))),
        );
    }

    /// A LOOKUP of `name` in `parent` answered here: one more reference.
    /// None if Python must answer it; a name found expired is dropped.
    pub fn lookup(
        &self,
        parent: u64,
        name: &[u8],
        now: Instant,
        gone: &mut Vec<u64>,
    ) -> Option<Found> {
        let mut state = self.state();
        let key = (parent, name.to_vec());
        let entry = state.names.get(&key)?;
        let (inode, fresh_until) = (entry.inode, entry.fresh_until);
        if fresh_until <= now {
            state.names.remove(&key);
            state.unname(inode, gone);
            return None;
        }
        let record = state.records.get_mut(&inode)?;
        record.references += 1;
        Some(Found {
            inode,
            attr: record.attr,
            timeout: (fresh_until - now).as_secs_f64(),
        })
    }

    /// How long the kernel may keep an entry or attributes: the TTL, or no
    /// time for ones that change under it.
    pub fn timeout(&self, cacheable: bool) -> f64 {
        if cacheable {
            self.ttl.as_secs_f64()
        } else {
            0.0
        }
    }

    /// Python opened listing `handle` of `directory`: its entries' inodes
    /// (made by Python, held or not) stay until it is released.
    pub fn set_listing(&self, handle: u64, directory: u64, entries: Vec<Listed>) {
        let mut state = self.state();
        for entry in entries.iter().filter(|entry| !entry.is_dot()) {
            let record = state.records.entry(entry.inode).or_insert(Record {
                attr: entry.attr,
                cacheable: entry.cacheable,
                references: 0,
                pins: 0,
                name: None,
                blocks: None,
                whole: None,
            });
            record.pins += 1;
        }
        let listing = Arc::new(Listing { directory, entries });
        state.listings.insert(handle, listing);
    }

    pub fn listing(&self, handle: u64) -> Option<Arc<Listing>> {
        self.state().listings.get(&handle).cloned()
    }

    /// Listing `handle` was released; false if there is none. The inodes
    /// only it kept are gone.
    pub fn release_listing(&self, handle: u64, now: Instant, gone: &mut Vec<u64>) -> bool {
        let mut state = self.state();
        let Some(listing) = state.listings.remove(&handle) else {
            return false;
        };
        for entry in listing.entries.iter().filter(|entry| !entry.is_dot()) {
            let Some(record) = state.records.get_mut(&entry.inode) else {
                continue;
            };
            record.pins = record.pins.saturating_sub(1);
            if record.references == 0 && record.pins == 0 && !state.fresh_name(entry.inode, now) {
                state.remove(entry.inode, gone);
            }
        }
        true
    }

    /// A GETATTR answered here: a version's attributes never change.
    pub fn getattr(&self, inode: u64) -> Option<(Attr, f64)> {
        let state = self.state();
        let record = state
            .records
            .get(&inode)
            .filter(|record| record.cacheable)?;
        Some((record.attr, self.timeout(true)))
    }

    /// The file of all of `inode`'s bytes, for a passthrough open, if named.
    pub fn whole(&self, inode: u64) -> Option<Arc<BlockFile>> {
        let state = self.state();
        let record = state
            .records
            .get(&inode)
            .filter(|record| record.cacheable)?;
        record.whole.clone()
    }

    /// Whether `inode` is a version the kernel may open here (not staged).
    pub fn cacheable(&self, inode: u64) -> bool {
        self.state()
            .records
            .get(&inode)
            .is_some_and(|record| record.cacheable)
    }

    /// Where the bytes `[offset, offset + size)` of `inode` lie, clipped to
    /// its end, if every block they touch has a verified file here.
    pub fn read_plan(&self, inode: u64, offset: u64, size: u32) -> Option<Vec<Piece>> {
        let state = self.state();
        let record = state
            .records
            .get(&inode)
            .filter(|record| record.cacheable)?;
        let blocks = record.blocks.as_ref()?;
        plan(blocks, offset, u64::from(size))
    }

    /// Names past their TTL go, with the inodes only they kept; at most once a `SWEEP_INTERVAL`.
    pub fn sweep(&self, now: Instant, gone: &mut Vec<u64>) {
        let mut state = self.state();
        if now.duration_since(state.swept) < SWEEP_INTERVAL {
            return;
        }
        state.swept = now;
        let expired: Vec<Name> = state
            .names
            .iter()
            .filter(|(_, entry)| entry.fresh_until <= now)
            .map(|(name, _)| name.clone())
            .collect();
        for name in expired {
            if let Some(entry) = state.names.remove(&name) {
                state.unname(entry.inode, gone);
            }
        }
    }
}

impl State {
    fn fresh_name(&self, inode: u64, now: Instant) -> bool {
        let Some(name) = self
            .records
            .get(&inode)
            .and_then(|record| record.name.as_ref())
        else {
            return false;
        };
        self.names
            .get(name)
            .is_some_and(|entry| entry.inode == inode && entry.fresh_until > now)
    }

    /// `inode`'s name no longer leads to it: gone too if unreferenced.
    fn unname(&mut self, inode: u64, gone: &mut Vec<u64>) {
        if let Some(record) = self.records.get_mut(&inode) {
            record.name = None;
            if record.references == 0 && record.pins == 0 {
                self.remove(inode, gone);
            }
        }
    }

    fn remove(&mut self, inode: u64, gone: &mut Vec<u64>) {
        if let Some(record) = self.records.remove(&inode) {
            if let Some(name) = record.name {
                if self
                    .names
                    .get(&name)
                    .is_some_and(|entry| entry.inode == inode)
                {
                    self.names.remove(&name);
                }
            }
            gone.push(inode);
        }
    }
}

/// Block maths: the pieces of `[offset, offset + size)` of a file cut in
/// blocks, or None if a block it touches has no file.
fn plan(blocks: &Blocks, offset: u64, size: u64) -> Option<Vec<Piece>> {
    let end = blocks.size.min(offset.saturating_add(size));
    let mut pieces = Vec::new();
    let mut at = offset;
    while at < end {
        let index = at / blocks.block_size;
        let block_start = index * blocks.block_size;
        let block_end = (block_start + blocks.block_size).min(blocks.size);
        let upto = end.min(block_end);
        let file = blocks.files.get(&index)?;
        pieces.push(Piece {
            file: Arc::clone(file),
            offset: file.offset + (at - block_start),
            length: (upto - at) as usize,
        });
        at = upto;
    }
    Some(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    fn attr(ino: u64) -> Attr {
        Attr {
            ino,
            size: 10,
            mtime: 0.0,
            mode: 0o100444,
            nlink: 1,
            uid: 0,
            gid: 0,
        }
    }

    fn file(index: u64) -> (u64, BlockFile) {
        let identity = FileIdentity {
            dev: 1,
            ino: index,
            ctime_ns: 0,
        };
        let path = PathBuf::from(format!("/blocks/{index}"));
        let tier = Arc::from("hot");
        (
            index,
            BlockFile {
                path,
                offset: 0,
                identity,
                tier,
            },
        )
    }

    /// `hold` of a name with one reference.
    fn held(tables: &Tables, inode: u64, name: &[u8], cacheable: bool, now: Instant) -> Vec<u64> {
        let mut gone = Vec::new();
        tables.hold(inode, 1, name, attr(inode * 10), cacheable, now, &mut gone);
        gone
    }

    #[test]
    fn a_name_held_is_answered_with_its_inode_until_its_ttl() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        let found = tables
            .lookup(1, b"f", start + Duration::from_secs(4), &mut vec![])
            .unwrap();
        assert_eq!((found.inode, found.attr.ino), (5, 50));
        assert!((found.timeout - 6.0).abs() < 1e-6); // what is left of the TTL, not a new one
        assert!(tables.lookup(1, b"f", start + TTL, &mut vec![]).is_none());
        assert!(tables.lookup(1, b"g", start, &mut vec![]).is_none());
    }

    #[test]
    fn an_inode_forgotten_while_its_name_is_fresh_stays_until_the_name_goes() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        assert!(!tables.forget(5, 1, start));
        assert!(tables.holds(5));
        assert_eq!(tables.lookup(1, b"f", start, &mut vec![]).unwrap().inode, 5); // revived: one reference
        assert!(!tables.forget(5, 1, start));
        let mut gone = Vec::new();
        tables.drop_name(1, b"f", &mut gone);
        assert!(!tables.holds(5));
        assert_eq!(gone, vec![5]);
    }

    #[test]
    fn an_unreferenced_inode_goes_when_its_name_expires_or_names_another() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        assert!(tables.forget(5, 1, start + TTL)); // forgotten after its name expired
        held(&tables, 6, b"g", true, start);
        tables.forget(6, 1, start);
        assert_eq!(held(&tables, 7, b"g", true, start), vec![6]); // a new version under that name
        held(&tables, 8, b"h", true, start);
        tables.forget(8, 1, start);
        let mut gone = Vec::new();
        tables.sweep(start + SWEEP_INTERVAL, &mut gone);
        assert_eq!(gone, vec![8]);
        assert!(tables.holds(7)); // still referenced
    }

    #[test]
    fn a_staged_file_is_counted_but_never_answered() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        tables.set_blocks(
            5,
            10,
            4,
            0..3,
            vec![file(0), file(1), file(2)],
            Some(file(9).1),
        );
        assert!(tables.read_plan(5, 0, 10).is_some());
        assert!(tables.whole(5).is_some());
        tables.uncache(5); // opened to be replaced
        assert!(tables.lookup(1, b"f", start, &mut vec![]).is_none());
        assert!(tables.getattr(5).is_none());
        assert!(tables.read_plan(5, 0, 10).is_none());
        assert!(tables.whole(5).is_none() && !tables.cacheable(5));
        held(&tables, 5, b"f", false, start); // looked up again, still staged
        assert!(tables.lookup(1, b"f", start, &mut vec![]).is_none());
        assert!(!tables.forget(5, 1, start));
        assert!(tables.forget(5, 1, start)); // no name keeps a staged file
    }

    #[test]
    fn a_read_is_planned_only_over_blocks_with_files_and_clipped_to_the_end() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        tables.set_blocks(5, 10, 4, 0..3, vec![file(0), file(1), file(2)], None);
        tables.set_blocks(5, 10, 4, 1..2, vec![], None); // block 1's file went
        let pieces = tables.read_plan(5, 1, 2).unwrap();
        assert_eq!((pieces[0].offset, pieces[0].length), (1, 2));
        assert!(tables.read_plan(5, 2, 4).is_none()); // touches block 1
        let tail = tables.read_plan(5, 8, 100).unwrap();
        assert_eq!((tail.len(), tail[0].length), (1, 2));
        assert!(tables.read_plan(5, 10, 4).unwrap().is_empty()); // at the end: no bytes
        assert!(tables.read_plan(6, 0, 4).is_none());
    }

    fn listed(inode: u64, name: &[u8]) -> Listed {
        Listed {
            name: name.to_vec(),
            inode,
            attr: attr(inode * 10),
            cacheable: true,
        }
    }

    #[test]
    fn a_listings_inodes_stay_while_it_is_open_and_go_after_unless_held() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        let entries = vec![
            listed(1, b"."),
            listed(1, b".."),
            listed(5, b"a"),
            listed(6, b"b"),
        ];
        tables.set_listing(9, 1, entries);
        assert!(tables.holds(5) && tables.holds(6) && !tables.holds(1)); // dots are not pinned
        assert_eq!(tables.listing(9).unwrap().entries.len(), 4);
        held(&tables, 5, b"a", true, start); // sent by READDIRPLUS
        assert!(!tables.forget(5, 1, start + TTL)); // still pinned by the open listing
        held(&tables, 5, b"a", true, start + TTL);
        let mut gone = Vec::new();
        assert!(tables.release_listing(9, start + TTL, &mut gone));
        assert_eq!(gone, vec![6]); // never sent: only the listing kept it
        assert!(tables.holds(5)); // referenced
        assert!(tables.listing(9).is_none());
        assert!(!tables.release_listing(9, start, &mut gone));
    }

    #[test]
    fn a_staged_inode_stays_uncached_and_a_name_it_takes_lets_the_old_inode_go() {
        let start = Instant::now();
        let tables = Tables::new(TTL, start);
        held(&tables, 5, b"f", true, start);
        tables.uncache(5); // opened to be replaced
        held(&tables, 5, b"f", true, start); // a listing taken before says it is a version
        assert!(!tables.cacheable(5) && tables.getattr(5).is_none());
        held(&tables, 6, b"g", true, start);
        tables.forget(6, 1, start); // kept by its fresh name only
        assert_eq!(held(&tables, 7, b"g", false, start), vec![6]); // a staged file now under that name
        assert!(!tables.holds(6));
    }
}
