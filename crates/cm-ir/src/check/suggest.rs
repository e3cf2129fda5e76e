//! Suggestions: the closest known name to a misspelt one, for "did you mean" hints (of the
//! checker's unknown names and fields, and of binding's unknown parameters).

/// The Levenshtein distance between `a` and `b`, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest candidate within a small edit distance, for "did you mean" hints.
pub fn suggest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    candidates
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| {
            *d <= 2.max(name.len() / 3)
                && (*d < c.len() || name.starts_with(c) || c.starts_with(name))
        })
        .min()
        .map(|(_, c)| c.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Levenshtein distance by the textbook recurrence on all prefixes, memoised: an
    /// independent reference for the two-row version.
    fn reference(a: &str, b: &str) -> usize {
        let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
        let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
        for i in 0..=a.len() {
            for j in 0..=b.len() {
                d[i][j] = if i == 0 || j == 0 {
                    i + j
                } else {
                    (d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]))
                        .min(d[i - 1][j] + 1)
                        .min(d[i][j - 1] + 1)
                };
            }
        }
        d[a.len()][b.len()]
    }

    #[test]
    fn edit_distance_matches_the_recurrence() {
        let words = [
            "", "q", "k", "kv_len", "q_len", "window", "windw", "wnidow", "é", "éa", "lengths",
        ];
        for a in words {
            for b in words {
                assert_eq!(edit_distance(a, b), reference(a, b), "{a:?} {b:?}");
            }
        }
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn suggestions_are_close_and_never_unrelated() {
        let names = ["window", "q_len", "kv_len", "lengths", "q"];
        let s = |n: &str| suggest(n, names.iter().copied());
        assert_eq!(s("windw").as_deref(), Some("window"));
        assert_eq!(s("kvlen").as_deref(), Some("kv_len"));
        assert_eq!(s("lenghts").as_deref(), Some("lengths"));
        // Replacing every character of a short name is no suggestion.
        assert_eq!(s("x"), None);
        assert_eq!(s("zzzzzz"), None);
        // A prefix counts even when it is all that is left.
        assert_eq!(s("qq").as_deref(), Some("q"));
        assert_eq!(suggest("a", std::iter::empty()), None);
    }
}
