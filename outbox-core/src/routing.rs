//! Destination templates shared by the publishers: `outbox.event.{aggregate_type}`, `{event_type}`...
//!
//! A template is text with placeholders `{aggregate_type}`, `{aggregate_id}` and `{event_type}`;
//! `{{` and `}}` stand for literal braces. It is parsed (and so validated) once, at configuration time.

use crate::error::Error;
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

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True when the template has no placeholder (one fixed destination).
    pub fn is_fixed(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Text(_)))
    }

    /// The destination of `event`.
    pub fn render(&self, event: &Event) -> String {
        let mut out = String::with_capacity(self.source.len() + 32);
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::AggregateType => out.push_str(&event.aggregate_type),
                Part::AggregateId => out.push_str(&event.aggregate_id),
                Part::EventType => out.push_str(&event.event_type),
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
}
