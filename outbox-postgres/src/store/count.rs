//! A count pass: one kind of rows (pending or dead letters) counted in chunks, one chunk per
//! statistics call, and the figure to report meanwhile. The statements that read the chunks are
//! the statistics' (`stats`).

use std::collections::BTreeMap;

/// Rows of one event type in a count: how many, and when the oldest was written (seconds since the
/// Unix epoch, by the database's clock).
pub(super) type TypeCounts = BTreeMap<String, (u64, Option<f64>)>;

/// A count of one kind of rows (pending or dead letters) taken in chunks of `stats_max_rows` rows,
/// one chunk per statistics call, each going on in `seq` order from where the previous one stopped.
/// A kind with fewer rows than a chunk is counted whole, exactly, at every call; a larger one is
/// counted over several calls, and its figure is the last complete pass (or the pass in progress,
/// once that has counted more). A pass counts the rows up to the last `seq` there was when it started:
/// rows written meanwhile wait for the next pass, so a pass ends however fast rows arrive.
#[derive(Debug, Default)]
pub(super) struct CountPass {
    /// Where the next chunk starts: after this `seq` (`None`: a new pass, from the oldest row).
    pub(super) cursor: Option<i64>,
    /// The last `seq` of the kind when the pass in progress started.
    pub(super) end: Option<i64>,
    /// The pass in progress.
    pub(super) partial: TypeCounts,
    /// The last complete pass, and whether it took more than one chunk.
    pub(super) last: Option<(TypeCounts, bool)>,
}

impl CountPass {
    /// Adds a chunk of `rows` rows (by type), the last at `last_seq`; a chunk smaller than `cap`
    /// ends the pass.
    pub(super) fn add(&mut self, chunk: TypeCounts, rows: u64, last_seq: Option<i64>, cap: u64) {
        for (event_type, (n, oldest)) in chunk {
            let entry = self.partial.entry(event_type).or_insert((0, None));
            entry.0 += n;
            entry.1 = match (entry.1, oldest) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        match last_seq {
            Some(seq) if rows >= cap => self.cursor = Some(seq),
            _ => {
                let multi = self.cursor.is_some();
                self.last = Some((std::mem::take(&mut self.partial), multi));
                self.cursor = None;
                self.end = None;
            }
        }
    }

    /// The figure to report, and whether it is other than one exact count of this moment.
    pub(super) fn report(&self) -> (TypeCounts, bool) {
        let total = |c: &TypeCounts| c.values().map(|(n, _)| n).sum::<u64>();
        match &self.last {
            Some((last, multi)) if self.cursor.is_none() || total(last) >= total(&self.partial) => {
                (last.clone(), *multi || self.cursor.is_some())
            }
            _ => (self.partial.clone(), true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_passes_report_the_last_complete_count_or_a_larger_partial_one() {
        let chunk = |n: u64| TypeCounts::from([("t".to_string(), (n, Some(1.0)))]);
        let total = |c: &TypeCounts| c.values().map(|(n, _)| n).sum::<u64>();
        let mut p = CountPass::default();
        p.add(chunk(5), 5, Some(9), 10);
        assert_eq!(p.report().0, chunk(5), "under a chunk: exact at once");
        assert!(!p.report().1);
        p.add(chunk(10), 10, Some(20), 10);
        assert_eq!(
            total(&p.report().0),
            10,
            "a larger partial pass shows at once"
        );
        assert!(p.report().1);
        p.add(chunk(10), 10, Some(30), 10);
        p.add(chunk(3), 3, Some(33), 10);
        let (c, estimated) = p.report();
        assert_eq!((total(&c), estimated), (23, true), "a pass of three chunks");
        p.add(chunk(10), 10, Some(10), 10);
        assert_eq!(
            total(&p.report().0),
            23,
            "the next pass, smaller so far, waits"
        );
        p.add(chunk(0), 0, None, 10);
        assert_eq!(total(&p.report().0), 10);
    }
}
