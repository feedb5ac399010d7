//! Destination templates shared by the publishers: `outbox.event.{aggregate_type}`, `{event_type}`...
//!
//! A template is text with placeholders `{aggregate_type}`, `{aggregate_id}` and `{event_type}`;
//! `{{` and `}}` stand for literal braces. It is parsed (and so validated) once, at configuration time.

use crate::error::{Error, ErrorKind};
use crate::event::Event;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    AggregateType,
    AggregateId,
    EventType,
}

/// A parsed destination template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

impl Template {
    /// Parses `source`; `key` names the configuration key in errors.
    ///
    /// # Errors
    /// A config error naming the key when a placeholder is unknown or a brace is unbalanced, or the
    /// template is empty.
    pub fn parse(key: &str, source: &str) -> Result<Self, Error> {
        if source.trim().is_empty() {
            return Err(Error::config(format!(
                "{key} is empty: expected a name or a template such as \"outbox.event.{{aggregate_type}}\""
            )));
        }
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut chars = source.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    text.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    text.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    let mut closed = false;
                    for n in chars.by_ref() {
                        if n == '}' {
                            closed = true;
                            break;
                        }
                        name.push(n);
                    }
                    if !closed {
                        return Err(Error::config(format!(
                            "{key} = {source:?} has an unclosed `{{`: expected placeholders {{aggregate_type}}, {{aggregate_id}} or {{event_type}} (write `{{{{` for a literal brace)"
                        )));
                    }
                    let part = match name.trim() {
                        "aggregate_type" => Part::AggregateType,
                        "aggregate_id" => Part::AggregateId,
                        "event_type" => Part::EventType,
                        other => {
                            return Err(Error::config(format!(
                                "{key} = {source:?} has an unknown placeholder {{{other}}}: expected {{aggregate_type}}, {{aggregate_id}} or {{event_type}}"
                            )))
                        }
                    };
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(part);
                }
                '}' => {
                    return Err(Error::config(format!(
                        "{key} = {source:?} has an unmatched `}}`: write `}}}}` for a literal brace"
                    )))
                }
                other => text.push(other),
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        Ok(Template {
            source: source.to_string(),
            parts,
        })
    }

    /// `prefix` followed by `{aggregate_type}` (a default that needs no parsing).
    pub(crate) fn prefix_then_aggregate_type(prefix: &str) -> Template {
        Template {
            source: format!("{prefix}{{aggregate_type}}"),
            parts: vec![Part::Text(prefix.to_string()), Part::AggregateType],
        }
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True when the template has no placeholder (one fixed destination).
    pub fn is_fixed(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Text(_)))
    }

    /// True when the template renders the same for every event of an aggregate (no `{event_type}`).
    pub fn is_per_aggregate(&self) -> bool {
        !self.parts.iter().any(|p| matches!(p, Part::EventType))
    }

    /// The destination of `event`.
    pub fn render(&self, event: &Event) -> String {
        self.render_with(event, std::borrow::Cow::Borrowed)
    }

    /// The template for `event`, each placeholder's value passed through `value` (to escape it).
    pub fn render_with<'e>(
        &self,
        event: &'e Event,
        value: impl Fn(&'e str) -> std::borrow::Cow<'e, str>,
    ) -> String {
        let mut out = String::with_capacity(self.source.len() + 32);
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::AggregateType => out.push_str(&value(&event.aggregate_type)),
                Part::AggregateId => out.push_str(&value(&event.aggregate_id)),
                Part::EventType => out.push_str(&value(&event.event_type)),
            }
        }
        out
    }

    /// The destination of `event`: its own `destination` when set, else this template rendered.
    pub fn destination(&self, event: &Event) -> String {
        match &event.destination {
            Some(d) => d.clone(),
            None => self.render(event),
        }
    }
}

impl Template {
    /// The destinations this template can produce, as an [`AllowList`] pattern: its text with each
    /// placeholder as `*`.
    pub fn pattern(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.as_str(),
                _ => "*",
            })
            .collect()
    }
}

/// Which destinations (topics, exchanges, queues) a publisher may send to.
///
/// Anyone who can insert into the outbox can set an event's `destination`; without a rule, an event
/// could reach any topic, exchange or queue the relay's credentials reach. A publisher allows its
/// configured routing (its fixed destination, or its template with each placeholder as `*`) and the
/// patterns of its `allowed_destinations` setting, where `*` matches any run of characters (`"*"`
/// alone allows every destination name). An event routed elsewhere fails permanently
/// ([`ErrorKind::PermissionDenied`], so it is dead-lettered) with an error naming the setting.
///
/// The routing itself is a rule too: writers choose the aggregate and event types, so a template
/// made only of placeholders (`{event_type}`) already lets them reach any destination its pattern
/// matches (`*`); prefix such templates (`events.{event_type}`) to keep them apart from the rest.
/// Likewise, with AMQP's default exchange configured (`amqp.exchange = ""`), the routing key names
/// the queue and is not checked here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowList {
    key: String,
    patterns: Vec<String>,
}

impl AllowList {
    /// The configured routing `routing` (a pattern, see [`Template::pattern`]) plus `extra`, from
    /// the setting `key` (such as `kafka.allowed_destinations`).
    ///
    /// # Errors
    /// A config error naming `key` when a pattern is empty.
    pub fn new(key: &str, routing: String, extra: &[String]) -> Result<Self, Error> {
        let mut patterns = vec![routing];
        for p in extra {
            if p.trim().is_empty() {
                return Err(Error::config(format!(
                    "{key} holds an empty pattern: expected names or patterns such as \"orders.*\" (\"*\" allows every destination)"
                )));
            }
            if !patterns.contains(p) {
                patterns.push(p.clone());
            }
        }
        Ok(AllowList {
            key: key.to_string(),
            patterns,
        })
    }

    /// Whether `destination` matches a pattern. An empty destination (AMQP's default exchange, which
    /// delivers to any queue named by the routing key) matches only an empty configured routing, never
    /// a pattern; a URL (an SQS queue URL, possibly of another account) matches only patterns that are
    /// URLs themselves.
    pub fn allows(&self, destination: &str) -> bool {
        if destination.is_empty() {
            return self.patterns[0].is_empty();
        }
        let url = destination.contains("://");
        self.patterns.iter().any(|p| {
            if url {
                // Path by path: a `*` never reaches into another segment (`/123/*` is not
                // `/123/x/../999/q`).
                let (ps, ds): (Vec<&str>, Vec<&str>) =
                    (p.split('/').collect(), destination.split('/').collect());
                p.contains("://")
                    && ps.len() == ds.len()
                    && ps.iter().zip(&ds).all(|(p, d)| glob(p, d))
            } else {
                !p.contains("://") && glob(p, destination)
            }
        })
    }

    /// `Ok` when `destination` is allowed; otherwise a permanent error naming the rule.
    ///
    /// # Errors
    /// [`ErrorKind::PermissionDenied`] naming the destination, the setting and its patterns.
    pub fn check(&self, destination: &str) -> Result<(), Error> {
        if self.allows(destination) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "destination {destination:?} is not allowed: {} allows {} (the configured routing first); \
                 add the destination or a pattern such as \"prefix.*\" to {} (\"*\" allows every destination)",
                self.key,
                self.patterns
                    .iter()
                    .map(|p| format!("{p:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.key
            ),
        ))
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (none included).
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev() -> Event {
        Event {
            id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            event_type: "order.created".into(),
            payload: vec![],
            content_type: "application/json".into(),
            headers: Default::default(),
            destination: None,
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    #[test]
    fn renders_placeholders() {
        let t = Template::parse("kafka.topic", "outbox.event.{aggregate_type}").unwrap();
        assert!(t.is_per_aggregate());
        assert!(!Template::parse("k", "events.{event_type}")
            .unwrap()
            .is_per_aggregate());
        assert_eq!(t.render(&ev()), "outbox.event.order");
        assert!(!t.is_fixed());
        let t = Template::parse("k", "{event_type}/{aggregate_id}{{x}}").unwrap();
        assert_eq!(t.render(&ev()), "order.created/42{x}");
        let t = Template::parse("k", "fixed").unwrap();
        assert!(t.is_fixed());
        let mut e = ev();
        e.destination = Some("special".into());
        assert_eq!(t.destination(&e), "special");
        assert_eq!(t.destination(&ev()), "fixed");
    }

    #[test]
    fn rejects_bad_templates_naming_the_key() {
        for bad in ["", "a.{nope}", "a.{event_type", "a}b"] {
            let err = Template::parse("amqp.routing_key", bad).unwrap_err();
            assert!(err.message().starts_with("amqp.routing_key"), "{err}");
        }
    }

    #[test]
    fn the_allow_list_takes_the_routing_and_the_patterns() {
        let t = Template::parse("kafka.topic", "outbox.event.{aggregate_type}").unwrap();
        assert_eq!(t.pattern(), "outbox.event.*");
        let a = AllowList::new("kafka.allowed_destinations", t.pattern(), &[]).unwrap();
        assert!(a.allows("outbox.event.order"));
        assert!(a.allows("outbox.event."));
        assert!(!a.allows("payments.ledger"));
        assert!(!a.allows("outbox.events"));
        let e = a.check("payments.ledger").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(!e.is_retryable());
        assert!(
            e.message().contains("\"payments.ledger\" is not allowed")
                && e.message()
                    .contains("kafka.allowed_destinations allows \"outbox.event.*\""),
            "{e}"
        );
        let a = AllowList::new(
            "k",
            "fixed".into(),
            &["audit.*.v?".into(), "*.dlq".into(), "exact".into()],
        )
        .unwrap();
        for ok in [
            "fixed",
            "audit.x.v?",
            "audit..v?",
            "orders.dlq",
            ".dlq",
            "exact",
        ] {
            assert!(a.allows(ok), "{ok}");
        }
        for no in ["fixed2", "audit.x.v1", "orders.dlq2", "exactly", ""] {
            assert!(!a.allows(no), "{no}");
        }
        let all = AllowList::new("k", "fixed".into(), &["*".into()]).unwrap();
        assert!(all.allows("anything at all"));
        assert!(!all.allows(""), "the default exchange only when configured");
        assert!(AllowList::new("k", String::new(), &[]).unwrap().allows(""));
        assert!(
            !all.allows("https://sqs.us-east-1.amazonaws.com/999/other"),
            "a URL only by a URL pattern"
        );
        let urls = AllowList::new(
            "k",
            "q".into(),
            &["https://sqs.us-east-1.amazonaws.com/123/*".into()],
        )
        .unwrap();
        assert!(urls.allows("https://sqs.us-east-1.amazonaws.com/123/orders"));
        assert!(!urls.allows("https://sqs.us-east-1.amazonaws.com/999/orders"));
        assert!(!urls.allows("https://sqs.us-east-1.amazonaws.com/123/x/../999/q"));
        assert!(AllowList::new("k", "fixed".into(), &[" ".into()])
            .unwrap_err()
            .message()
            .starts_with("k holds an empty pattern"));
    }
}
